import pytest

from dataparallel.testing import ChannelConformance, free_port


class TestGrpcChannel(ChannelConformance):
    @pytest.fixture
    def channel_url(self):
        return f"grpc://127.0.0.1:{free_port()}"
