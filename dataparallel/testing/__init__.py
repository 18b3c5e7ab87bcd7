"""The conformance suite as importable pytest classes (see :mod:`.conformance`)."""

from .conformance import (
    ChannelConformance,
    CollectiveTests,
    LinearizabilityTests,
    LivenessTests,
    MembershipTests,
    PrimitiveTests,
    RelayedConformance,
    RelayTests,
    RunTests,
    StoreTests,
    TimeoutTests,
    close_all,
    free_port,
    run_all,
    with_options,
)

__all__ = [
    "ChannelConformance",
    "CollectiveTests",
    "LinearizabilityTests",
    "LivenessTests",
    "MembershipTests",
    "PrimitiveTests",
    "RelayTests",
    "RelayedConformance",
    "RunTests",
    "StoreTests",
    "TimeoutTests",
    "close_all",
    "free_port",
    "run_all",
    "with_options",
]
