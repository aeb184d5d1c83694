"""Generated from the .proto files in this folder by scripts/gen_protos.py; do not edit."""
