import itertools

import pytest

from dataparallel.testing import ChannelConformance

_names = itertools.count()


class TestMemoryChannel(ChannelConformance):
    cross_process = False  # ranks of memory:// are threads of one process

    @pytest.fixture
    def channel_url(self):
        return f"memory://conformance-{next(_names)}"
