import pytest

from dataparallel.testing import ChannelConformance, free_port


class TestZmqChannel(ChannelConformance):
    @pytest.fixture
    def channel_url(self):
        return f"zmq://127.0.0.1:{free_port()}"
