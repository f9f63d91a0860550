"""The runner process: load the model, then execute plans in order into the token mailbox.

It publishes the model limits (KV blocks, max_model_len, vocabulary, EOS ids) on the status
board as soon as the model is loaded; the other stages build themselves from them. It also
makes the mailbox, whose kind (host or device slots) follows its device.
"""
from __future__ import annotations

from pipeline.llm import build_runner, serving_max_model_len
from shm.ring import RingReader, RingWriter
from stages import messages as msg
from stages.gpu_runner.mailbox import MailboxWriter, create_mailbox
from stages.gpu_runner.offload import OffloadConnectorWorker
from stages.process import StageContext, run_stage
from stages.status import ModelLimits

NUM_MAILBOX_CONSUMERS = 2  # the scheduler and the detokenizer
MAILBOX_WAIT_S = 60.0  # consumers release a slot within a step or two; longer means they are stuck


def main(spec_json: str) -> None:
    run_stage(spec_json, serve)


def serve(ctx: StageContext) -> None:
    spec, config = ctx.spec, ctx.spec["config"]
    worker = OffloadConnectorWorker(None) if config["kv_connector"] == "offload" else None
    runner = build_runner(
        config["model"], device=config["device"], dtype=config["dtype"], block_size=config["block_size"],
        num_kv_blocks=config["num_kv_blocks"], max_num_seqs=config["max_num_seqs"],
        max_model_len=config["max_model_len"], max_num_batched_tokens=config["max_num_batched_tokens"],
        kv_connector=worker, seed=config["seed"])
    mailbox_name = create_mailbox(spec["instance"], num_slots=config["mailbox_slots"],
                                  max_rows=config["max_num_seqs"], num_consumers=NUM_MAILBOX_CONSUMERS,
                                  cuda=runner.device.type == "cuda")
    mailbox = MailboxWriter(mailbox_name, runner.device)
    plans = RingReader.attach(spec["rings"]["plan"])
    done = RingWriter.attach(spec["rings"]["done"])
    ctx.board.publish_limits(ModelLimits(
        num_kv_blocks=runner.num_kv_blocks,
        max_model_len=serving_max_model_len(runner.max_model_len, runner.num_kv_blocks, config["block_size"],
                                            config["max_model_len"]),
        vocab_size=runner.vocab_size, eos_token_ids=runner.eos_token_ids,
        num_host_blocks=0 if worker is None else worker.num_host_blocks))
    step_range, execute_range, publish_range = ctx.range("step"), ctx.range("execute"), ctx.range("publish")
    runner.phase = ctx.range  # prepare_inputs, forward and sample inside execute
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
                                     timeout_s=MAILBOX_WAIT_S, check=ctx.tick)
                ctx.write(done, msg.Kind.DONE, msg.encode_done(plan.step, slot, int(output.token_ids.shape[0])))
