"""Crash consistency: SIGKILL an engine with host and disk tiers at random moments, restart it on
the same directories, and check what the restarted engine serves and finds.

Each run is a child process: an in-process vLLM engine (CPU, a random-weight Llama) with
kvtier's connector, a small host tier written back to a disk tier, serving temperature-0
requests whose prefixes repeat. A run serves two rounds, then shuts down:

- ``write-back``: half the prompts, in a random order; blocks computed now go to the host tier,
  and the host tier's evictions are written back to disk (blocks left on disk by earlier runs
  are promoted from it);
- ``promotion``: the same prefixes with other suffixes, found on disk and promoted;
- ``shutdown``: the engine stops, and the host tier's blocks the disk lacks are flushed.

The first run is vanilla vLLM (no kvtier), the reference every later output must equal token
for token. Then ``--kills`` runs are each killed with SIGKILL, in a phase chosen at random, a
random fraction of that phase's duration (as observed so far) after it began; a last run
serves everything and stops cleanly. Each run picks the disk tier's ``capacity_bytes`` at
random (half, once or twice the base), so every restart also shrinks or grows the tier.

After each kill, before the restart, the disk file is read with the record format's own checks:
the distinct keys whose record is intact, and those whose newest record is torn. The restarted
tier must hold the intact ones, within one record (``accounting_error``), in a file no larger
than its capacity; the tier directory must hold nothing but its file; and nothing the killed
engine had open in the temporary directory (``TMPDIR``, one for all the runs with kvtier) or in
``/dev/shm`` may still be there once the last run stopped, and the temporary directory must then
be empty, but for the files vLLM itself makes there (:data:`VLLM_FILES`), listed apart.
``ok`` is true when every check held.

Prints one JSON object. Usage::

    python benchmarks/crash.py --kills 20
    python benchmarks/crash.py --kills 3 --seed 1 --work /tmp/crash
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import kvtier
from kvtier.tiers.disk import HEADER_AREA_BYTES, SUPERBLOCK_BYTES, DiskTier
from kvtier.tiers.record import RecordCodec, RecordFault

KVTIER_ROOT = str(Path(kvtier.__file__).resolve().parents[1])
PHASES = ("write-back", "promotion", "shutdown")
MARK = "@crash "
"""Start of the child's protocol lines on its standard output (vLLM logs there too)."""
BLOCK_TOKENS = 32
PREFIXES = 24
PREFIX_BLOCKS = 6
SUFFIX_TOKENS = 40
MAX_TOKENS = 4
HOST_BYTES = 512 << 10
"""The host tier: 32 slots of the model's 16 KiB records, far fewer than a round's blocks, so it
evicts (and writes back) while each run serves."""
BASE_DISK_BYTES = 4 << 20
"""The disk tier's base capacity: about 200 of those records."""
CAPACITY_FACTORS = (0.5, 1.0, 2.0)
VLLM_FILES = ("vllm_dist_",)
"""Names of files vLLM itself makes in the temporary directory (its in-process engine's
``torch.distributed`` rendezvous file), which a killed engine leaves behind: reported apart,
since kvtier neither makes them nor can tell a stale one from another engine's."""
RUN_TIMEOUT_S = 300.0
ENGINE_ENVIRONMENT = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_ATTN_SPLIT_KV": "0",
}
"""One process per engine (its SIGKILL kills the whole engine), and CPU attention that rounds a
request the same way whatever shares its step (tests/integrations/vllm/conftest.py says why)."""


def prompts(seed: int) -> dict[str, list[int]]:
    """Every prompt by id (``p<prefix>s<suffix>``): a shared prefix of whole blocks, then a
    suffix of its own."""
    rng = random.Random(seed)
    universe: dict[str, list[int]] = {}
    for p in range(PREFIXES):
        prefix = [rng.randrange(1000) for _ in range(PREFIX_BLOCKS * BLOCK_TOKENS)]
        for s in range(2):
            universe[f"p{p}s{s}"] = prefix + [rng.randrange(1000) for _ in range(SUFFIX_TOKENS)]
    return universe


def rounds(run_seed: int) -> list[tuple[str, list[str]]]:
    """A run's rounds: half the prefixes in a random order, then the same with the other
    suffix."""
    rng = random.Random(run_seed)
    chosen = rng.sample(range(PREFIXES), PREFIXES // 2)
    first = [rng.randrange(2) for _ in chosen]
    return [
        ("write-back", [f"p{p}s{s}" for p, s in zip(chosen, first, strict=True)]),
        ("promotion", [f"p{p}s{1 - s}" for p, s in zip(chosen, first, strict=True)]),
    ]


# ------------------------------------------------------------------------------- the child


def say(event: str, **fields: Any) -> None:
    print(MARK + json.dumps({"event": event, "t": time.monotonic(), **fields}), flush=True)


def disk_tier_of_engine() -> DiskTier:
    """The disk tier of the in-process engine's worker (its only lower tier)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    chain = get_kv_transfer_group().worker.offload._mover.chain
    ((_, tier),) = chain.tiers
    assert isinstance(tier, DiskTier)
    return tier


def child(spec: dict[str, Any]) -> None:
    """One run: start, report what the disk tier found, serve the rounds, shut down."""
    from vllm import LLM

    from kvtier.integrations.vllm.offline import engine_kwargs, generate, shutdown

    universe = prompts(spec["seed"])
    kvtier = spec["kvtier"]
    started = time.monotonic()
    llm = LLM(
        **engine_kwargs(
            spec["model"], kvtier=kvtier, num_device_blocks=64, max_model_len=512, max_num_seqs=4
        )
    )
    if kvtier is not None:
        tier = disk_tier_of_engine()
        stats = tier.stats()
        say(
            "start",
            start_s=time.monotonic() - started,
            records=stats.records,
            fingerprint=tier.keys.layout_fingerprint,
            record_bytes=tier.record_bytes,
            num_slots=tier.num_slots,
            file=str(tier.file),
        )
    else:
        say("start", start_s=time.monotonic() - started)
    schedule = rounds(spec["run_seed"]) if kvtier is not None else [("all", sorted(universe))]
    for phase, ids in schedule:
        say("phase", phase=phase)
        outputs = generate(llm, [universe[i] for i in ids], MAX_TOKENS)
        say("outputs", phase=phase, outputs=dict(zip(ids, outputs, strict=True)))
    stats = disk_tier_of_engine().stats() if kvtier is not None else None
    say(
        "phase",
        phase="shutdown",
        records=stats.records if stats is not None else None,
        errors={str(k): v for k, v in stats.errors.items()} if stats is not None else {},
    )
    shutdown(llm)
    say("stopped")


# ------------------------------------------------------------------------------ the parent


def audit(file: Path, fingerprint: str, record_bytes: int, slots: int) -> dict[str, int]:
    """The records in the first ``slots`` slots of a disk tier's file, by its own checks:
    distinct keys whose newest record is intact, and those whose newest record is torn."""
    codec = RecordCodec(fingerprint, record_bytes)
    slot_bytes = DiskTier.slot_bytes_for(record_bytes)
    newest: dict[bytes, tuple[int, bool]] = {}
    with file.open("rb") as f:
        for slot in range(slots):
            f.seek(SUPERBLOCK_BYTES + slot * slot_bytes)
            area = f.read(HEADER_AREA_BYTES)
            header = codec.parse(area)
            if isinstance(header, RecordFault):
                continue
            intact = not isinstance(
                codec.unseal(header.key, header, f.read(record_bytes)), RecordFault
            )
            if header.key not in newest or newest[header.key][0] < header.sequence:
                newest[header.key] = (header.sequence, intact)
    intact = sum(ok for _, ok in newest.values())
    return {"intact": intact, "torn": len(newest) - intact}


def open_paths(pid: int, under: tuple[str, ...]) -> set[str]:
    """Files under ``under`` that process ``pid`` has open or mapped."""
    found: set[str] = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                found.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                continue
        with open(f"/proc/{pid}/maps") as maps:
            found.update(line.split(maxsplit=5)[-1].strip() for line in maps if "/" in line)
    except OSError:
        pass
    return {path for path in found if path.startswith(under)}


def run_child(
    spec: dict[str, Any], log: Path, kill_phase: str | None, kill_fraction: float,
    durations: dict[str, float], tmp: Path,
) -> dict[str, Any]:  # fmt: skip
    """Run one child; SIGKILL it ``kill_fraction`` of ``kill_phase``'s duration into it."""
    # The child imports the kvtier this process imported, wherever the script is run from.
    path = os.pathsep.join(filter(None, (KVTIER_ROOT, os.environ.get("PYTHONPATH"))))
    env = {**os.environ, **ENGINE_ENVIRONMENT, "TMPDIR": str(tmp), "PYTHONPATH": path}
    command = [sys.executable, __file__, "--child", json.dumps(spec)]
    events: list[dict[str, Any]] = []
    killed: dict[str, Any] = {}
    with log.open("ab") as err:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=err, env=env, start_new_session=True
        )

    def kill() -> None:
        if process.poll() is None:
            killed["open"] = sorted(open_paths(process.pid, (str(tmp), "/dev/shm")))
            killed["in_phase"] = next(
                (e["phase"] for e in reversed(events) if e["event"] == "phase"), "start"
            )
            os.killpg(process.pid, signal.SIGKILL)

    timer: threading.Timer | None = None
    guard = threading.Timer(RUN_TIMEOUT_S, kill)
    guard.start()
    assert process.stdout is not None
    for raw in process.stdout:
        line = raw.decode(errors="replace")
        if not line.startswith(MARK):
            continue
        event = json.loads(line[len(MARK) :])
        events.append(event)
        if event["event"] == "phase" and event["phase"] == kill_phase and timer is None:
            timer = threading.Timer(kill_fraction * durations[kill_phase], kill)
            timer.start()
    process.wait()
    guard.cancel()
    if timer is not None:
        timer.join()
    return {"events": events, "returncode": process.returncode, "killed": killed}


def phase_durations(events: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds from each phase's start to the next event after it."""
    found: dict[str, float] = {}
    for event, following in zip(events, events[1:], strict=False):
        if event["event"] == "phase":
            found[event["phase"]] = following["t"] - event["t"]
    return found


def crash_runs(args: argparse.Namespace) -> dict[str, Any]:
    """The vanilla reference, ``args.kills`` killed runs and a clean one; every check."""
    from kvtier.integrations.checkpoints import TinyLlamaSpec, write_tiny_llama

    work = Path(args.work or tempfile.mkdtemp(prefix="kvtier-crash-"))
    work.mkdir(parents=True, exist_ok=True)
    model = str(write_tiny_llama(work / "model", TinyLlamaSpec()))
    disk = work / "disk"
    log = work / "engine.log"
    rng = random.Random(args.seed)
    base = {"model": model, "seed": args.seed}

    vanilla_tmp = work / "tmp-vanilla"
    vanilla_tmp.mkdir(exist_ok=True)
    vanilla = run_child({**base, "kvtier": None, "run_seed": 0}, log, None, 0, {}, vanilla_tmp)
    if vanilla["returncode"] != 0:
        raise RuntimeError(f"the vanilla run failed; see {log}")
    reference = next(e for e in vanilla["events"] if e["event"] == "outputs")["outputs"]
    durations = {"write-back": 1.0, "promotion": 1.0, "shutdown": 1.0}

    tmp = work / "tmp"
    tmp.mkdir(exist_ok=True)
    rows: list[dict[str, Any]] = []
    left_open: set[str] = set()
    last_start: dict[str, Any] | None = None
    for number in range(args.kills + 1):
        final = number == args.kills
        capacity = int(BASE_DISK_BYTES * rng.choice(CAPACITY_FACTORS))
        kvtier = {
            "cpu_bytes": HOST_BYTES,
            "tiers": [{"type": "disk", "path": str(disk), "capacity_bytes": capacity}],
        }
        on_disk: dict[str, int] | None = None
        if last_start is not None:
            slots = min(
                (capacity - SUPERBLOCK_BYTES)
                // DiskTier.slot_bytes_for(last_start["record_bytes"]),
                last_start["num_slots"],
            )
            on_disk = audit(
                Path(last_start["file"]), last_start["fingerprint"], last_start["record_bytes"],
                slots,
            )  # fmt: skip
        phase = None if final else rng.choice(PHASES)
        fraction = rng.random()
        run = run_child(
            {**base, "kvtier": kvtier, "run_seed": number + 1}, log, phase, fraction, durations, tmp
        )
        events = run["events"]
        for name, seconds in phase_durations(events).items():
            durations[name] = max(durations.get(name, 0.0), seconds)
        start = next((e for e in events if e["event"] == "start"), None)
        wrong = [
            key
            for e in events
            if e["event"] == "outputs"
            for key, tokens in e["outputs"].items()
            if tokens != reference[key]
        ]
        row: dict[str, Any] = {
            "run": number,
            "capacity_bytes": capacity,
            "kill_phase": phase,
            "kill_fraction": round(fraction, 3),
            "killed_in": run["killed"].get("in_phase"),
            "outputs_checked": sum(len(e["outputs"]) for e in events if e["event"] == "outputs"),
            "wrong_outputs": len(wrong),
            "returncode": run["returncode"],
        }
        if start is not None:
            file = Path(start["file"])
            row |= {
                "start_s": round(start["start_s"], 2),
                "records_found": start["records"],
                "file_bytes": file.stat().st_size,
                "file_fits": file.stat().st_size <= capacity,
                "stray_files": sorted(p.name for p in disk.iterdir() if p != file),
            }
            if on_disk is not None:
                row |= {
                    "intact_on_disk": on_disk["intact"],
                    "torn_on_disk": on_disk["torn"],
                    "accounting_error": start["records"] - on_disk["intact"],
                }
            last_start = start
        stopped = next(
            (e for e in events if e["event"] == "phase" and e["phase"] == "shutdown"), None
        )
        if stopped is not None:
            row["records_served_from"] = stopped["records"]
            row["read_faults"] = stopped["errors"]
        left_open.update(run["killed"].get("open", []))
        rows.append(row)
        if final and run["returncode"] != 0:
            raise RuntimeError(f"the last run did not stop cleanly; see {log}")

    leftovers = {path for path in left_open if os.path.exists(path)}
    leftovers.update(str(path) for path in tmp.iterdir())
    made_by_vllm = sorted(path for path in leftovers if Path(path).name.startswith(VLLM_FILES))
    kills = rows[:-1]
    ok = (
        all(row["wrong_outputs"] == 0 and row.get("start_s") is not None for row in rows)
        and all(abs(row.get("accounting_error", 0)) <= 1 for row in rows)
        and all(row["file_fits"] and not row["stray_files"] for row in rows)
        and all(row["returncode"] == -signal.SIGKILL for row in kills)
        and leftovers == set(made_by_vllm)
    )
    return {
        "kills": args.kills,
        "seed": args.seed,
        "work": str(work),
        "outputs_checked": sum(row["outputs_checked"] for row in rows),
        "wrong_outputs": sum(row["wrong_outputs"] for row in rows),
        "max_accounting_error": max(
            (abs(row.get("accounting_error", 0)) for row in rows), default=0
        ),
        "killed_in": {p: sum(row["killed_in"] == p for row in kills) for p in ("start", *PHASES)},
        "leftovers": sorted(leftovers - set(made_by_vllm)),
        "leftovers_of_vllm": made_by_vllm,
        "ok": ok,
        "runs": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20, help="runs killed (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="prompts, phases and moments")
    parser.add_argument("--work", help="directory for the model, the tier and the logs")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        child(json.loads(args.child))
        return 0
    result = crash_runs(args)
    print(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
