"""Crash-test driver: durable puts into an SsdTier until killed.

    python ssd_put_driver.py PATH START [--threads 4] [--block-bytes 1048576] [--count N]

Opens the SSD tier at PATH, prints "READY", then loops: each of the threads takes the
next index (from START up), puts block `block_key(i)` with `block_payload(i)` durably
and, once `put` returned (the commit is on disk), prints "ACK <i>" and flushes. Runs
until killed, or until N puts were acknowledged with --count.

The test imports `block_key` and `block_payload` from this file to check what survived.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import threading

import numpy as np

from quillcache_core.model import KvBlockKey

BLOCK_BYTES = 1024 * 1024
CAPACITY_BYTES = 64 * 1024**3


def block_key(index: int) -> KvBlockKey:
    return KvBlockKey(
        model_id="crash-model",
        tokenizer_id="crash-tok",
        adapter_id=None,
        tenant_id="crash-tenant",
        prefix_hash="root",
        block_hash=f"{index:032x}",
        block_index=index,
        token_count=16,
    )


def block_payload(index: int, nbytes: int = BLOCK_BYTES) -> bytes:
    return np.random.default_rng(index).bytes(nbytes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("path")
    parser.add_argument("start", type=int)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--block-bytes", type=int, default=BLOCK_BYTES)
    parser.add_argument("--count", type=int, default=0)
    args = parser.parse_args(argv)

    from quillcache_store.tiers.ssd import SsdTier

    tier = SsdTier(args.path, CAPACITY_BYTES)
    out = sys.stdout
    out_lock = threading.Lock()
    counter = itertools.count(args.start)
    counter_lock = threading.Lock()
    acked = itertools.count(1)
    done = threading.Event()

    def worker() -> None:
        while not done.is_set():
            with counter_lock:
                index = next(counter)
            tier.put(block_key(index), block_payload(index, args.block_bytes), durable=True)
            with out_lock:
                out.write(f"ACK {index}\n")
                out.flush()
                if args.count and next(acked) >= args.count:
                    done.set()

    out.write("READY\n")
    out.flush()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(args.threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    tier.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
