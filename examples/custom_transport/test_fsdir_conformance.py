"""The whole conformance suite, run against the third-party ``fsdir://`` transport."""

import pytest

from dataparallel.testing import ChannelConformance, RelayedConformance


class TestFsDirChannel(ChannelConformance):
    @pytest.fixture
    def channel_url(self, tmp_path):
        return f"fsdir://{tmp_path}/shared"


class TestFsDirThroughNodeRelays(RelayedConformance):
    """The suite again (but its run and linearizability tests), every rank behind a node relay joined to it."""

    @pytest.fixture
    def upstream_url(self, tmp_path):
        return f"fsdir://{tmp_path}/shared"
