"""The runner process: load the model, then execute plans in order into the token mailbox.

It publishes the model limits (KV blocks, max_model_len, vocabulary, EOS ids) on the status
board as soon as the model is loaded; the other stages build themselves from them. It also
makes the mailbox, whose kind (host or device slots) follows its device.
"""
from __future__ import annotations

from shm.mailbox import MailboxWriter, create_mailbox
from stages import messages as msg
from stages.contracts.params import MAX_LOGPROBS
from stages.contracts.topology import MAILBOX_READERS
from stages.gpu_runner.build import build_runner, model_limits
from stages.process import StageContext, run_stage

MAILBOX_WAIT_S = 60.0  # consumers release a slot within a step or two; longer means they are stuck


def main(spec_json: str) -> None:
    run_stage(spec_json, serve)


def serve(ctx: StageContext) -> None:
    config = ctx.config
    runner = build_runner(config)
    create_mailbox(ctx.instance, num_slots=config.mailbox_slots, max_rows=config.max_num_seqs,
                   logprob_width=1 + MAX_LOGPROBS, num_consumers=len(MAILBOX_READERS),
                   cuda=runner.device.type == "cuda")
    mailbox = MailboxWriter(ctx.mailbox_name, runner.device)
    plans, done = ctx.reader("plan"), ctx.writer("done")
    ctx.board.publish_limits(model_limits(runner, config))
    step_range, execute_range, publish_range = ctx.range("step"), ctx.range("execute"), ctx.range("publish")
    runner.phase = ctx.range  # prepare_inputs, forward and sample inside execute
    runner.copy_to_host = False  # the mailbox carries the tokens: no pinned copy and event per step
    ctx.ready()
    while True:
        ctx.tick()
        record = ctx.read_input(plans)
        if record is None:
            continue
        with step_range:
            plan = msg.decode_plan(record.payload)
            if record.kind == msg.Kind.CONNECTOR_FLUSH:
                runner.kv_connector.save(plan.connector_meta)
                continue
            with execute_range:
                output = runner.execute(plan)
            with publish_range:
                slot = mailbox.write(plan.step, output.token_ids, output.logprobs, output.logprob_token_ids,
                                     timeout_s=MAILBOX_WAIT_S, check=ctx.tick, ready_at_ns=output.ready_at_ns)
                ctx.write(done, msg.Kind.DONE, msg.encode_done(plan.step, slot, int(output.token_ids.shape[0])))
