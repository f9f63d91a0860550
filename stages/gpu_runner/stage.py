"""The runner process: load the model, then execute plans in order into the token mailbox.

It publishes the model limits (KV blocks, max_model_len, vocabulary, EOS ids) on the status
board as soon as the model is loaded; the other stages build themselves from them. It also
makes the mailbox, whose kind (host or device slots) follows its device.

Under tensor parallelism every rank of this machine is a runner stage reading the same plan ring
(`runner` is rank 0, `runner1`... the others); they join one process group first. Rank 0 alone
publishes limits, makes the mailbox and writes `done`; the others only run each plan on their
shard (runner.py has them receive the sampled ids from rank 0 on the device).
"""
from __future__ import annotations

import torch

from shm.mailbox import MailboxWriter, create_mailbox
from stages import messages as msg
from stages.contracts.params import MAX_LOGPROBS
from stages.contracts.topology import MAILBOX_READERS, runner_rank
from stages.gpu_runner import worker
from stages.gpu_runner.build import build_runner, model_limits
from stages.gpu_runner.models.config import load_model_config, resolve_device
from stages.gpu_runner.parallel.group import TensorParallel, naming_lost_peers
from stages.gpu_runner.parallel.sharding import check_tensor_parallel
from stages.gpu_runner.runner import ModelRunner
from stages.process import StageContext, run_stage

MAILBOX_WAIT_S = 60.0  # consumers release a slot within a step or two; longer means they are stuck


def main(spec_json: str) -> None:
    run_stage(spec_json, serve)


def serve(ctx: StageContext) -> None:
    tp = join_ranks(ctx)
    with naming_lost_peers(tp, ctx.config.master_addr, ctx.config.master_port):
        serve_rank(ctx, tp)


def serve_rank(ctx: StageContext, tp: TensorParallel | None) -> None:
    config = ctx.config
    if ctx.cores is not None:  # run_stage pinned the runner: one forward thread on each of its cores
        torch.set_num_threads(len(ctx.cores))
    runner = build_runner(config, tp)
    if tp is not None and not tp.is_driver:
        follow_plans(ctx, runner)
        return
    # A row verifying K drafts yields up to K + 1 tokens a step.
    create_mailbox(ctx.instance, num_slots=config.mailbox_slots,
                   max_rows=config.max_num_seqs * (1 + config.num_speculative_tokens),
                   logprob_width=1 + MAX_LOGPROBS, num_consumers=len(MAILBOX_READERS),
                   cuda=runner.device.type == "cuda")
    mailbox = MailboxWriter(ctx.mailbox_name, runner.device)
    plans, done = ctx.reader("plan"), ctx.writer("done")
    ctx.board.limits.publish(model_limits(runner, config))
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


def join_ranks(ctx: StageContext) -> TensorParallel | None:
    """This stage's place in the tensor-parallel group (None without one); a size the model or
    the machine cannot take is refused before any rank waits for another."""
    config = ctx.config
    if config.tensor_parallel_size == 1:
        return None
    check_tensor_parallel(load_model_config(config.model), config.tensor_parallel_size, resolve_device(config.device),
                          config.ranks_per_node, config.enable_expert_parallel)
    return worker.join(config, runner_rank(ctx.name), config.ranks_per_node, check=ctx.tick)


def follow_plans(ctx: StageContext, runner: ModelRunner) -> None:
    """A rank other than 0: run every plan of the ring on this rank's shard."""
    plans = ctx.reader("plan")
    runner.copy_to_host = False  # rank 0 alone hands the tokens on
    ctx.ready()
    while True:
        ctx.tick()
        record = ctx.read_input(plans)
        if record is not None:
            runner.execute(msg.decode_plan(record.payload))
