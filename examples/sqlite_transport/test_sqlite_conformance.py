"""The whole conformance suite, run against the third-party ``sqlite://`` transport."""

import pytest

from dataparallel.testing import ChannelConformance, RelayedConformance


class TestSqliteChannel(ChannelConformance):
    @pytest.fixture
    def channel_url(self, tmp_path):
        return f"sqlite://{tmp_path}/store.db"


class TestSqliteThroughNodeRelays(RelayedConformance):
    """The suite again (but its run and linearizability tests), every rank behind a node relay joined to it."""

    @pytest.fixture
    def upstream_url(self, tmp_path):
        return f"sqlite://{tmp_path}/store.db"
