"""The whole conformance suite, run against the third-party ``fsdir://`` transport."""

import pytest

from dataparallel.testing import ChannelConformance, RelayedConformance


class TestFsDirChannel(ChannelConformance):
    @pytest.fixture
    def channel_url(self, tmp_path):
        return f"fsdir://{tmp_path}/shared"


class TestFsDirThroughNodeRelays(RelayedConformance):
    """The key/value and Store tests again, every rank behind a node relay joined to it."""

    @pytest.fixture
    def upstream_url(self, tmp_path):
        return f"fsdir://{tmp_path}/shared"
