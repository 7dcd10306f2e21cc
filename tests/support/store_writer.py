"""A child process for crash tests: appends with sync flush from several threads and prints one line
per record once it is durable: `DURABLE <offset> <subject> <seq> <message id>`.

Run as `python -m tests.support.store_writer DIR ROUND`; it runs until killed.
"""

import random
import sys
import threading

from qmq.store.store import LogStore, Message
from tests.support.stores import SMALL, payload_for

WRITER_THREADS = 4
SUBJECTS = ("orders", "payments", "reminders")


def main() -> None:
    data_dir, round_no = sys.argv[1], int(sys.argv[2])
    store = LogStore(data_dir, SMALL)
    out_lock = threading.Lock()
    print("READY", flush=True)

    def writer(t: int) -> None:
        rng = random.Random(round_no * 100 + t)
        n = 0
        while True:
            batch = []
            for _ in range(rng.randint(1, 64)):
                mid = f"r{round_no}-t{t}-{n}"
                n += 1
                batch.append(
                    Message(
                        rng.choice(SUBJECTS), mid, payload_for(mid), key=f"key-{n % 5}", tags=(rng.choice(("a", "b")),)
                    )
                )
            results = store.append_durable(batch)
            lines = "".join(
                f"DURABLE {r.offset} {m.subject} {r.seq} {m.message_id}\n" for m, r in zip(batch, results, strict=True)
            )
            with out_lock:
                sys.stdout.write(lines)
                sys.stdout.flush()

    threads = [threading.Thread(target=writer, args=(t,), daemon=True) for t in range(WRITER_THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


if __name__ == "__main__":
    main()
