"""The whole conformance suite, run against the third-party ``fsdir://`` transport."""

import pytest

from dataparallel.testing import ChannelConformance


class TestFsDirChannel(ChannelConformance):
    @pytest.fixture
    def channel_url(self, tmp_path):
        return f"fsdir://{tmp_path}/shared"
