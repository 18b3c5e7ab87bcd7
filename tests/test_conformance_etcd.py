import itertools

import pytest
from etcdserver import EtcdServer, require_etcd

from dataparallel.testing import ChannelConformance

_prefixes = itertools.count()


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    require_etcd()
    server = EtcdServer(tmp_path_factory.mktemp("etcd")).start().wait_ready()
    yield server
    server.stop()


class TestEtcdChannel(ChannelConformance):
    @pytest.fixture
    def channel_url(self, etcd):
        return f"{etcd.url}/conformance{next(_prefixes)}"
