"""Generated protobuf code for ``protos/dataparallel/control/v1/control.proto``."""
