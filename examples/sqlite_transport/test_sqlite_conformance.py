"""The whole conformance suite, run against the third-party ``sqlite://`` transport."""

import pytest

from dataparallel.testing import ChannelConformance


class TestSqliteChannel(ChannelConformance):
    @pytest.fixture
    def channel_url(self, tmp_path):
        return f"sqlite://{tmp_path}/store.db"
