"""Child-process bodies for the stage tests (importable by 'spawn'ed children)."""
from __future__ import annotations

from multiprocessing.synchronize import Event

from shm.ring import RingReader
from stages import messages as msg
from shm.mailbox import MailboxReader


def consume(mailbox_name: str, done_name: str, num_steps: int, out: object, gate: Event) -> None:
    """Read `num_steps` steps as the done ring announces them; hold step 0 until `gate` is set.
    out[step * 8 + i] gets row i's token id, out[step * 8 + 4 + i] its first logprob * 1000."""
    reader = MailboxReader(mailbox_name, 0)
    done = RingReader.attach(done_name)
    for _ in range(num_steps):
        record = done.read(timeout=10.0)
        step, slot, num_rows = msg.decode_done(record.payload)
        data = reader.read(step, slot)
        for i in range(num_rows):
            out[step * 8 + i] = int(data.token_ids[i])
            if data.logprobs is not None:
                out[step * 8 + 4 + i] = int(round(float(data.logprobs[i, 0]) * 1000))
        if step == 0:
            gate.wait(10.0)
        reader.release(step)


def hold_forever(mailbox_name: str) -> None:
    """Attach as consumer 0 and never release anything (until killed)."""
    MailboxReader(mailbox_name, 0)
    import time

    time.sleep(60)


def run_backend_then_hang(model: str, pids: object, instance_out: object) -> None:
    """A stand-in daemon: start a Backend, report its stage pids and instance, then hang
    (the test kills this process to see the stages follow)."""
    import time

    from backend_helpers import start_backend

    backend = start_backend(model)
    for index, health in enumerate(backend.health()):
        pids[index] = health.pid
    instance_out.value = backend.instance.encode()
    time.sleep(120)
