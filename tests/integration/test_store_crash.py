"""Crash consistency of the SSD tier under a real SIGKILL.

A driver process (tests/support/ssd_put_driver.py) does durable 1 MiB puts from 4
threads and prints "ACK <i>" after each acknowledged put. It is killed at a random
point 20 times; after each kill the tier is reopened here and must hold every ACKed
block byte-identical, and serve nothing corrupt. The next run continues after the
highest index seen.
"""

from __future__ import annotations

import importlib.util
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quillcache_core.storeclient.blockcodec import payload_checksum
from quillcache_store.tiers.ssd import SsdTier

pytestmark = pytest.mark.integration

DRIVER = Path(__file__).resolve().parents[1] / "support" / "ssd_put_driver.py"
RUNS = 20
CAPACITY = 64 * 1024**3  # the driver's; nothing may be evicted


def _load_driver():
    spec = importlib.util.spec_from_file_location("ssd_put_driver", DRIVER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _acks(path: Path) -> tuple[bool, set[int]]:
    ready, acked = False, set()
    for line in path.read_text().splitlines(keepends=True):
        if not line.endswith("\n"):
            break  # a line cut by the kill
        if line == "READY\n":
            ready = True
        elif line.startswith("ACK "):
            acked.add(int(line[4:]))
    return ready, acked


def _wait_ready(proc: subprocess.Popen, out: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _acks(out)[0]:
            return
        if proc.poll() is not None:
            raise AssertionError(f"driver exited early with {proc.returncode}")
        time.sleep(0.005)
    raise AssertionError("driver never became ready")


def test_sigkill_never_loses_an_acked_put_nor_serves_corrupt_bytes(tmp_path):
    driver = _load_driver()
    db = tmp_path / "ssd"
    rng = random.Random(20240611)
    all_acked: set[int] = set()
    unacked_present = 0  # committed, but killed before its ACK was printed
    start = 0
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    began = time.monotonic()
    for run in range(RUNS):
        out = tmp_path / f"driver-{run}.out"
        err = tmp_path / f"driver-{run}.err"
        with out.open("w") as stdout, err.open("w") as stderr:
            proc = subprocess.Popen(
                [sys.executable, str(DRIVER), str(db), str(start)],
                stdout=stdout,
                stderr=stderr,
                env=env,
            )
            try:
                _wait_ready(proc, out)
                time.sleep(rng.uniform(0.05, 0.4))
                assert proc.poll() is None, err.read_text()
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=10)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        assert proc.returncode == -signal.SIGKILL
        _, acked = _acks(out)
        assert all(i >= start for i in acked)
        all_acked |= acked

        tier = SsdTier(db, CAPACITY)
        try:
            present = {k.block_index for k in tier.keys()}
            missing = sorted(all_acked - present)
            assert not missing, f"run {run}: ACKed blocks lost after SIGKILL: {missing[:10]}"
            # This run's blocks: ACKed ones, and any committed but not yet ACKed.
            top = max(present | all_acked | {start - 1})
            for index in range(start, top + 1):
                got = tier.get(driver.block_key(index))  # raises on anything corrupt
                if got is None:
                    assert index not in all_acked
                    continue
                unacked_present += index not in all_acked
                data, digest = got
                assert digest == payload_checksum(data)
                assert bytes(data) == driver.block_payload(index), f"block {index} differs"
            assert tier.stats()["corrupt_blocks"] == 0
        finally:
            tier.close()
        start = top + 1

    assert len(all_acked) >= RUNS, "the driver acknowledged almost nothing"
    # Final pass: everything that was ever stored is still there and intact.
    tier = SsdTier(db, CAPACITY)
    try:
        assert {k.block_index for k in tier.keys()} >= all_acked
        for key in tier.keys():
            data, _ = tier.get(key)
            assert bytes(data) == driver.block_payload(key.block_index)
        assert tier.stats()["corrupt_blocks"] == 0
    finally:
        tier.close()
    elapsed = time.monotonic() - began
    print(
        f"{RUNS} SIGKILLs: {len(all_acked)} ACKed puts all intact, {unacked_present} more "
        f"committed before their ACK, {elapsed:.1f}s"
    )
    assert elapsed < 90
