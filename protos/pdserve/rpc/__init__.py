"""Generated gRPC/protobuf code for pdserve (regenerate with protos/generate.py)."""
