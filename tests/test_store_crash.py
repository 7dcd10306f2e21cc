"""Crash tests: a child appends with sync flush and reports each durable record; it is SIGKILLed at
random moments, many times. After each reopen every reported record must be there, byte for byte,
the derived logs must agree with the message log, and `qmq log verify` must pass."""

import os
import random
import subprocess
import sys

from qmq.store.store import LogStore
from qmq.store.verify import verify
from tests.support.stores import SMALL, payload_for

ROUNDS = 50
MAX_RECORDS_BEFORE_KILL = 3000
SAMPLE_OF_EARLIER = 200  # records of older rounds checked after each round, besides the at-risk ones


def run_and_kill(processes, data_dir, round_no, rng):
    """Start a writer, let it report a random number of durable records, SIGKILL it. Returns the
    reported records. A threshold of 0 kills it while it may still be recovering."""
    proc = processes.start(
        ["-m", "tests.support.store_writer", str(data_dir), str(round_no)],
        name=f"writer-{round_no}",
        stdout=subprocess.PIPE,
    )
    threshold = rng.choice([0, rng.randint(1, 200), rng.randint(1, MAX_RECORDS_BEFORE_KILL)])
    reported = []
    if threshold:
        for line in proc.stdout:
            parts = line.decode().split()
            if parts[:1] == ["DURABLE"] and len(parts) == 5:
                reported.append((int(parts[1]), parts[2], int(parts[3]), parts[4]))
            if len(reported) >= threshold:
                break
    processes.kill(proc)
    # lines written before the kill but not read yet are durable too
    for line in proc.stdout.read().decode().splitlines():
        parts = line.split()
        if parts[:1] == ["DURABLE"] and len(parts) == 5:
            reported.append((int(parts[1]), parts[2], int(parts[3]), parts[4]))
    return reported


def at_risk(rounds: list[list[tuple]], rng: random.Random) -> list[tuple]:
    """The reported records a reopen could have lost: the last two rounds' whole, the last of every
    earlier round (a recovery that cut too far cuts it first) and a sample of the rest. Every
    record is checked once more at the end: checking all after every round made the test quadratic."""
    recent = [r for rnd in rounds[-2:] for r in rnd]
    earlier = [r for rnd in rounds[:-2] for r in rnd]
    lasts = [rnd[-1] for rnd in rounds[:-2] if rnd]
    return recent + lasts + rng.sample(earlier, min(SAMPLE_OF_EARLIER, len(earlier)))


def check_store(data_dir, reported):
    with LogStore(data_dir, SMALL) as store:
        for offset, subject, seq, message_id in reported:
            record = store.read_record(offset)
            assert (record.subject, record.seq, record.message_id) == (subject, seq, message_id)
            assert record.payload == payload_for(message_id)
            entry = store.entries(subject, seq, 1)[0]
            assert entry is not None and entry.offset == offset
        for message_id in random.sample([r[3] for r in reported], min(50, len(reported))):
            assert store.find_by_id(message_id).message_id == message_id
        for subject, next_seq in store.subjects().items():
            seqs = [r.seq for r in store.read(subject, 0, next_seq, max_scan=next_seq).records]
            assert seqs == list(range(next_seq)), f"{subject}: sequences have gaps"
    report = verify(data_dir)
    assert report.ok, report.problems


def test_sigkill_during_sync_appends_loses_nothing_reported(processes, tmp_path):
    seed = int(os.environ.get("QMQ_TEST_SEED") or random.randrange(1 << 30))
    rng = random.Random(seed)
    print(f"seed {seed} (QMQ_TEST_SEED={seed} replays the same kill points, timing allowing)")
    data_dir = tmp_path / "store"
    rounds: list[list[tuple]] = []
    for round_no in range(ROUNDS):
        rounds.append(run_and_kill(processes, data_dir, round_no, rng))
        check_store(data_dir, at_risk(rounds, rng))
    reported = [r for rnd in rounds for r in rnd]
    check_store(data_dir, reported)
    assert len(reported) > ROUNDS * 50
    cli = subprocess.run(
        [sys.executable, "-m", "qmq", "log", "verify", "--data-dir", str(data_dir)], capture_output=True, text=True
    )
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert "OK" in cli.stdout
