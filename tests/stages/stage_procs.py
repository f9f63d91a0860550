"""Child-process bodies for the stage tests (importable by 'spawn'ed children)."""
from __future__ import annotations

from multiprocessing.synchronize import Event

from shm.mailbox import MailboxReader, MailboxWriter
from shm.ring import RingWriter
from shm.ring_reader import RingReader
from stages import messages as msg


def consume(mailbox_name: str, done_name: str, num_steps: int, out: object, gate: Event, ready: Event) -> None:
    """Attach (on CUDA: initialise CUDA and open the runner's handles, which it has published),
    set `ready`, then read `num_steps` steps as the done ring announces them; hold step 0 until
    `gate` is set. out[step * 8 + i] gets row i's token id, out[step * 8 + 4 + i] its first
    logprob * 1000, out[24] whether the device side was open before the first read."""
    reader = MailboxReader(mailbox_name, 0)
    done = RingReader.attach(done_name)
    out[24] = int(reader.device_ready)
    ready.set()
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
    reader.close()


def produce_then_hang(mailbox_name: str, done_name: str, exported: Event, go: Event) -> None:
    """A CUDA runner stand-in: export the device slots, set `exported`; once `go` is set, queue a
    long kernel, write step 0 behind it, announce it, and hang (the test kills this process
    while the kernel still runs)."""
    import time

    import torch

    writer = MailboxWriter(mailbox_name, "cuda")
    done = RingWriter.attach(done_name)
    exported.set()
    token_ids = torch.tensor([1, 2], dtype=torch.int32, device="cuda")  # its upload waits for nothing
    go.wait(20.0)
    torch.cuda._sleep(4_000_000_000)  # about 2 s of GPU clock cycles
    slot = writer.write(0, token_ids)
    done.write(msg.Kind.DONE, msg.encode_done(0, slot, 2))
    time.sleep(60)


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
