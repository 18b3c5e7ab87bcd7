import itertools

import pytest
from etcdserver import silenced_server

from dataparallel.testing import ChannelConformance

_prefixes = itertools.count()


class TestEtcdChannel(ChannelConformance):
    @pytest.fixture
    def channel_url(self, etcd):
        return f"{etcd.url}/conformance{next(_prefixes)}"

    @pytest.fixture(autouse=True)
    def _scratch(self, tmp_path):
        self.scratch = tmp_path

    def silenceable_server(self, channel_url):
        """etcd's store is no rank's: a server of its own, for the timeout tests to freeze or kill."""
        return silenced_server(self.scratch / f"silenced{next(_prefixes)}")
