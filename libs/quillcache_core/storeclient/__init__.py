"""The store's client half: what every process that talks to a store node imports (the
store itself, transfer, the sim engine, the vLLM connector, the benchmarks).

- `client`: `StoreClient`, the gRPC client of a store node (puts, gets, exists, pulls).
- `wire`: the store's protobuf messages to and from the domain types.
- `blockcodec`: a block's record (identity, payload, checksum) as bytes.
- `datapath`: the raw block-data protocol (framing, pooled connections, batched puts
  and gets, blocking socket I/O).
"""
