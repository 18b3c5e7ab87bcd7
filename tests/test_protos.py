"""The committed protobuf code is what protos/ generates."""

from pathlib import Path

from dataparallel.control.generate import ROOT, generate


def test_generated_protobuf_code_is_up_to_date(tmp_path):
    fresh = generate(tmp_path)
    assert fresh, "protoc produced nothing"
    for path in fresh:
        committed = ROOT / path.relative_to(tmp_path)
        assert committed.exists(), f"{committed} is missing: run python -m dataparallel.control.generate"
        assert committed.read_bytes() == path.read_bytes(), (
            f"{committed.relative_to(ROOT)} is stale: run python -m dataparallel.control.generate"
        )


def test_proto_package_is_unique():
    text = (ROOT / "protos/dataparallel/control/v1/control.proto").read_text()
    assert "package dataparallel.control.v1;" in text
    assert Path(ROOT / "dataparallel/control/v1/control_pb2.py").exists()
