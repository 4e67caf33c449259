"""Generated protobuf and gRPC modules for specdec.v1 (see scripts/gen_protos.py)."""
