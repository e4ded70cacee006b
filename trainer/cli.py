"""The `trainer` command. Parsing imports nothing heavy, so `trainer --help` is instant."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys

from trainer import storage
from trainer.errors import ExitCode, TrainerError, UsageError, shorten
from trainer.exitstatus import record_exit, report

EXIT_CODES = """exit codes:
  0  done
  1  unexpected error (a bug: the traceback is printed)
  2  bad config, environment, data or checkpoint, or a run whose loss went NaN/inf (one line
     says what to fix; do not retry)
  3  stopped by SIGTERM/SIGINT after saving a checkpoint (rerun the same command to resume)
  4  transient failure (peer lost, timeout, I/O); a retry may succeed"""


NEWEST = "\0newest"
"""--resume without RUN_DIR (argparse's const: not a path anyone can type)."""

COMMANDS = ("train", "eval", "export", "doctor", "config", "plan", "report", "data", "diagnose")
"""The subcommands (trainer-launch runs `train` under torchrun and the others once)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        # argparse echoes arguments whole: a 100,000-character one must not be the whole line.
        message = re.sub(r"[^\s']{100,}", lambda m: shorten(m.group(0)), message)
        self.exit(ExitCode.USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        "-c",
        metavar="NAME_OR_PATH",
        help="a preset name (see `trainer config list`), a YAML file, or a run directory "
        "(default: digits-mlp)",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="config overrides, applied last, e.g. optim.lr=0.01 data.global_batch_size=128",
    )


def build_parser() -> argparse.ArgumentParser:
    """The `trainer` parser: a subparser per command, each added by its _add_<command>_command."""
    parser = _Parser(
        prog="trainer",
        description="Reproducible PyTorch training: one process of a job, launched directly or by torchrun.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    _add_train_command(sub)
    _add_eval_command(sub)
    _add_export_command(sub)
    _add_doctor_command(sub)
    _add_config_command(sub)
    _add_plan_command(sub)
    _add_report_command(sub)
    _add_data_command(sub)
    _add_diagnose_command(sub)
    return parser


def _add_train_command(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a model (one rank of a job under torchrun)",
        description="Train. Reads RANK/WORLD_SIZE/... from torchrun's environment; "
        "none set means a single process.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_config_args(p)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="build everything, run one step on the epoch's LAST (smallest) batch, one "
        "eval batch and a checkpoint save/load round trip, then exit",
    )
    p.add_argument(
        "--from",
        dest="from_run",
        metavar="RUN_DIR",
        help="re-run RUN_DIR's exact config.yaml into RUN_DIR/rerun (run_dir=... to change)",
    )
    p.add_argument(
        "--resume",
        nargs="?",
        const=NEWEST,
        metavar="RUN_DIR",
        help="continue a run from its newest checkpoint, with its config.yaml (key=value on top): "
        "RUN_DIR, or without it the newest run of runs/<name>/. Without --resume every "
        "`trainer train` starts a new folder, runs/<name>/<date-time>, unless run_dir= pins one",
    )
    p.set_defaults(func=_cmd_train)


def _add_eval_command(sub) -> None:
    p = sub.add_parser("eval", help="evaluate saved weights on the test split")
    p.add_argument(
        "src", help="a run directory, checkpoint directory or weights file, or an s3:// URL of one"
    )
    _add_config_args(p)
    p.set_defaults(func=_cmd_eval)


def _add_export_command(sub) -> None:
    p = sub.add_parser("export", help="write plain safetensors weights (loadable without trainer)")
    p.add_argument(
        "src",
        help="a run directory, checkpoint directory, or .pt/.pth/.safetensors file, or an "
        "s3:// URL of one",
    )
    p.add_argument(
        "-o",
        "--out",
        help="output directory or s3:// prefix, never inside a run but RUN/export (default: "
        "RUN/export for a run directory, SRC-export beside any other source; for an s3:// SRC, "
        "./NAME-export)",
    )
    p.add_argument(
        "--format",
        choices=("plain", "hf-gpt2"),
        default="plain",
        help="plain: our names (default); hf-gpt2: a Hugging Face GPT-2 folder (model.name=gpt)",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run: fold the adapters into the base weights (ckpt.init_weights)",
    )
    p.set_defaults(func=_cmd_export)


def _add_doctor_command(sub) -> None:
    p = sub.add_parser("doctor", help="check GPUs, NCCL/gloo, /dev/shm, ulimits, env, config, data")
    _add_config_args(p)
    p.set_defaults(func=_cmd_doctor)


def _add_config_command(sub) -> None:
    p = sub.add_parser(
        "config",
        help="show, check, list or explain configs",
        description="show: print the resolved config; check: validate it; list: the presets; "
        "explain [KEY|SECTION ...]: each key's description, type, range, default and resolved "
        "value (no key: the sections), e.g. `trainer config explain optim.lr data`",
    )
    p.add_argument(
        "action",
        choices=("show", "check", "list", "explain"),
        help="show: print the resolved config; check: validate it; list: the presets; "
        "explain [KEY|SECTION ...]: what each key means",
    )
    p.add_argument(
        "--world-size",
        type=int,
        metavar="N",
        help="check: also check that the global batch splits over N ranks",
    )
    _add_config_args(p)
    p.set_defaults(func=_cmd_config)


def _add_plan_command(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="each rank's memory before launch: parameters, gradients, optimizer, activations",
        description="Each rank's memory for the config's mesh, precision and optimizer, without "
        "starting processes or allocating the model (the model on the meta device, laid out "
        "over a fake process group): parameters, gradients and optimizer state exactly, "
        "activations of one micro-batch with and without activation checkpointing, and the "
        "expected peak (docs/training.md, 'When the model does not fit').",
    )
    p.add_argument("--world-size", type=int, default=1, metavar="N", help="ranks (default 1)")
    p.add_argument("--json", action="store_true", help="the plan as JSON, a record per rank")
    _add_config_args(p)
    p.set_defaults(func=_cmd_plan)


def _add_report_command(sub) -> None:
    p = sub.add_parser(
        "report",
        help="plot runs' metrics (overlaid) and compare them in a Markdown table",
        description="Read each RUN_DIR's metrics.jsonl, summary.json and run.json; write one PNG "
        "per quantity (train loss, each eval metric, lr, throughput, ...) with every run "
        "overlaid, and report.md: a row per run, throughput relative to the first run.",
    )
    p.add_argument(
        "runs", nargs="+", metavar="RUN_DIR", help="run directories (the first is the baseline)"
    )
    p.add_argument(
        "-o", "--out", metavar="OUT_DIR", help="output folder (default: FIRST_RUN_DIR/report)"
    )
    p.set_defaults(func=_cmd_report)


def _add_data_command(sub) -> None:
    p = sub.add_parser(
        "data",
        help="prepare data: tokenize text into token files; pack a dataset into shards",
        description="tokenize SRC -o OUT: write OUT/train.bin, OUT/test.bin and OUT/tokens.json "
        "from a text file or a folder of them, one file at a time (nanoGPT's format; train with "
        "data.name=tokens data.tokens.path=OUT). The split is data.name=text's. "
        "pack SRC -o OUT [data.key=value ...]: write a dataset as tar shards and an index to OUT, "
        "a new folder or s3://bucket/prefix (train with data.name=shards data.shards.path=OUT); "
        "SRC is an image folder (train/ and val/), an arrays or tokens folder, or a data.name "
        "(digits, cifar10, package.module:factory) with its data.* settings.",
    )
    p.add_argument(
        "action", choices=("tokenize", "pack"),
        help="tokenize: text -> token files; pack: a dataset -> shards",
    )  # fmt: skip
    p.add_argument("src", help="tokenize: a text file or folder; pack: a folder or a data.name")
    p.add_argument(
        "-o", "--out", required=True,
        help="the folder (pack: or s3:// prefix) to write to; it must be new or empty",
    )  # fmt: skip
    p.add_argument(
        "--tokenizer",
        default="bytes",
        help="tokenize: bytes (default: a vocabulary of 256) or package.module:obj, a callable "
        "from a file's bytes to its token ids with a vocab_size attribute",
    )
    p.add_argument(
        "--test-fraction",
        type=float,
        default=0.2,
        help="tokenize: share of files (or of the stream) for test",
    )
    p.add_argument("--split-seed", type=int, default=0, help="tokenize: seed of the per-file split")
    p.add_argument(
        "--shard-mb", type=float, default=64.0, help="pack: the size of each shard (default 64)"
    )
    p.add_argument(
        "--shuffle-seed", type=int, default=0,
        help="pack: the train samples are packed in an order shuffled from this seed (default "
        "0), so each shard holds a mix of the set (an image folder lists one class after another)",
    )  # fmt: skip
    p.add_argument(
        "--keep-order", action="store_true",
        help="pack: keep the source's order (then data.shards.window=0 trains to SRC's bits)",
    )  # fmt: skip
    p.add_argument(
        "overrides", nargs="*", metavar="data.key=value",
        help="pack: settings of the source dataset (data.image_size=64, data.kwargs.x=1, seed=1)",
    )  # fmt: skip
    p.set_defaults(func=_cmd_data)


def _add_diagnose_command(sub) -> None:
    p = sub.add_parser(
        "diagnose",
        help="say again which rank stalled and where, from a run's diagnostics/ files",
        description="Read RUN_DIR/diagnostics/ (written when a rank made no step for "
        "dist.stall_s, or a collective failed) and print who stalled where, and each rank's "
        "stack file.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run folder of the job that hung")
    p.set_defaults(func=_cmd_diagnose)


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") in ("", "0")


def load_config(args):
    """The Config the parsed arguments describe: --config (or --from RUN_DIR) and overrides."""
    from trainer import config

    overrides = args.overrides
    if getattr(args, "resume", None):
        return _resume_config(args)
    if getattr(args, "from_run", None):
        if args.config:
            raise UsageError("use --from RUN_DIR or --config, not both")
        if not os.path.isfile(os.path.join(args.from_run, "config.yaml")):
            raise UsageError(
                f"--from {args.from_run}: no config.yaml there (is it a run directory?)"
            )
        args.config = args.from_run
        overrides = [f"run_dir={os.path.join(args.from_run, 'rerun')}", *overrides]
    return config.load(args.config, overrides)


def _resume_config(args):
    """`--resume [RUN_DIR]`: that run's config.yaml (or --config's), key=value on top, its folder."""
    from trainer import config, rundir

    if args.from_run:
        raise UsageError("use --resume or --from RUN_DIR, not both")
    run_dir = args.resume
    if storage.is_url(run_dir):
        return _resume_from_bucket(args, run_dir)
    if run_dir != NEWEST and "=" in run_dir and not os.path.isdir(run_dir):
        args.overrides = [run_dir, *args.overrides]  # `--resume key=value`: argparse took it
        run_dir = NEWEST
    if run_dir == NEWEST:
        named = config.load(args.config, args.overrides)
        run_dir = named.run_dir or rundir.newest(named.name)  # pinned, or the newest
    if not os.path.isfile(os.path.join(run_dir, "config.yaml")):
        raise UsageError(
            f"--resume {run_dir}: no config.yaml there (is it a run folder? `ls runs/*/`)"
        )
    cfg = config.load(args.config or run_dir, [*args.overrides, f"run_dir={run_dir}"])
    if cfg.ckpt.resume == "never":
        raise UsageError("--resume with ckpt.resume=never: drop one of them")
    from trainer.checkpoint import store
    from trainer.checkpoint.manager import checkpoint_dir

    with storage.explained(f"--resume {run_dir}: ckpt.dir {cfg.ckpt.dir}"):
        empty = _is_rank0() and not store.list_checkpoints(checkpoint_dir(cfg))
    if empty:
        print(f"note: --resume {run_dir}: no checkpoint there yet, so it trains from step 0")
    return cfg


def _resume_from_bucket(args, url: str):
    """`--resume s3://bucket/prefix`: the config saved in its newest checkpoint that verifies
    (the bucket alone: a new pod's empty disk), key=value on top, checkpoints in that prefix."""
    storage.check_path("--resume", url)
    with storage.explained(f"--resume {url}"):
        return _resume_config_from(args, url)


def _resume_config_from(args, url: str):
    import hashlib
    import tempfile

    from trainer import config
    from trainer.checkpoint import bucket, store

    newest = store.latest_in(url, warn=_note)
    if newest is None:
        raise UsageError(
            f"--resume {url}: no checkpoint there (or in its checkpoints/) verifies: name the "
            "prefix a run's ckpt.dir was"
        )
    entry = bucket.verify(newest)["config.yaml"]
    text = storage.get_bytes(storage.join(newest, "config.yaml"))
    if hashlib.sha256(text).hexdigest() != entry["sha256"]:
        raise UsageError(f"--resume {url}: {newest}/config.yaml does not match its sha256")
    root = newest.rsplit("/", 1)[0]
    with tempfile.TemporaryDirectory(prefix="trainer-resume-") as folder:
        with open(os.path.join(folder, "config.yaml"), "wb") as f:
            f.write(text)
        cfg = config.load(args.config or folder, [*args.overrides, f"ckpt.dir={root}"])
    if cfg.ckpt.resume == "never":
        raise UsageError("--resume with ckpt.resume=never: drop one of them")
    return cfg


def _cmd_train(args) -> int:
    cfg = load_config(args)
    from trainer.signals import StopSignal

    # Installed before the heavy imports: a SIGTERM during setup is honoured, not fatal.
    with StopSignal() as stop:
        import torch._dynamo  # noqa: F401  (what every optimizer imports: while the collector is off)

        from trainer import startup
        from trainer.train import train

        startup.settle()  # imports done: the collector back on for the run's setup and training
        train(cfg, dry_run=args.dry_run, stop=stop)
    return ExitCode.OK


def _config_for(src: str, args):
    """The config that produced `src` (its config.yaml), unless --config names another."""
    from trainer import config
    from trainer.checkpoint.weights import find_config

    found = None if args.config else find_config(src)
    return config.load(args.config or found, args.overrides)


def _cmd_eval(args) -> int:
    import json

    from trainer import startup
    from trainer.run import evaluate_saved

    startup.settle()  # torch imported: the collector back on for the evaluation itself
    with _local(args.src) as src:
        result = evaluate_saved(_config_for(src, args), src)
    if _is_rank0():
        print(json.dumps(result))
    return ExitCode.OK


def _cmd_export(args) -> int:
    import tempfile

    from trainer import startup
    from trainer.checkpoint.weights import check_bucket_out, export, upload_export

    startup.settle()
    storage.check_path("export -o", args.out)
    out, bucket_out = args.out, storage.is_url(args.out)
    if bucket_out:  # before any work: nothing there it did not write itself
        check_bucket_out(out)
    if out is None and storage.is_url(args.src):  # beside the command, not in the local copy
        out = f"{storage.basename(args.src)}-export"
    with _local(args.src) as src, tempfile.TemporaryDirectory(prefix="trainer-export-") as tmp:
        merged = None
        if args.merge:
            from trainer import finetune

            def merged():
                return finetune.merged_weights(src)

        written = export(
            src, os.path.join(tmp, "export") if bucket_out else out, args.format, merged
        )
        if bucket_out:
            written = upload_export(os.path.dirname(written), out)
        print(f"exported {written}")
    return ExitCode.OK


@contextlib.contextmanager
def _local(src: str):
    """`src` itself, or what an s3:// URL names copied to local disk for the block (a checkpoint
    verified against its manifest, or one object)."""
    storage.check_path("source", src)
    if not storage.is_url(src):
        from trainer.checkpoint.weights import check_source

        check_source(src)  # no FIFO or device where a file is read: a read would hang
        yield src
        return
    from trainer.checkpoint import store

    with store.fetched(src, warn=_note) as local:
        yield local


def _note(message: str) -> None:
    """A line on stderr (stdout may carry a command's JSON), from rank 0 only."""
    if _is_rank0():
        print(f"note: {message}", file=sys.stderr)


def _cmd_doctor(args) -> int:
    from trainer import config, doctor

    checks = doctor.run(lambda: config.load(args.config, args.overrides))
    print(doctor.render(checks))
    return ExitCode.USAGE if any(level == "fail" for level, _, _ in checks) else ExitCode.OK


def _cmd_config(args) -> int:
    from trainer import config

    if args.action == "list":
        for name in config.presets():
            print(name)
        return ExitCode.OK
    keys = []
    if args.action == "explain":  # bare words are keys to explain; key=value still overrides
        keys = [a for a in args.overrides if "=" not in a]
        args.overrides = [a for a in args.overrides if "=" in a]
    cfg = config.load(args.config, args.overrides)
    if args.action == "explain":
        from trainer.config.explain import explain

        print(explain(cfg, keys))
    elif args.action == "show":
        print(config.to_yaml(cfg), end="")
    else:
        world_size = 1 if args.world_size is None else args.world_size
        from trainer import tracking  # no torch: the checks `train` makes first

        tracking.check(cfg, os.environ)
        config.check_world_size(cfg, world_size)
        config.resolve_strategy(cfg, world_size)
        later = _check_layout(cfg, world_size)
        print(f"config ok: {cfg.name} (data {cfg.data.name}, model {cfg.model.name}){later}")
    return ExitCode.OK


def _check_layout(cfg, world_size: int) -> str:
    """`config check`'s layout checks (dist.mesh against the model, as every rank makes them
    before any work, without building it): '' or, for a plug-in model whose split points and
    plan are checked when it is built, '; <that note>' for the ok line."""
    from trainer.config import layout_of
    from trainer.parallel.layout import check_model

    note = check_model(cfg, layout_of(cfg, world_size))
    return f"; {note}" if note else ""


def _cmd_plan(args) -> int:
    import dataclasses
    import json

    from trainer import config
    from trainer.plan import plan, table

    if args.world_size < 1:
        raise UsageError(f"--world-size {args.world_size}: must be >= 1 (the ranks in the job)")
    cfg = config.load(args.config, args.overrides)
    config.check_world_size(cfg, args.world_size)
    plans = plan(cfg, args.world_size)
    if args.json:
        print(json.dumps([dataclasses.asdict(p) | {"peak_bytes": p.peak_bytes} for p in plans]))
    else:
        print(table(plans))
    return ExitCode.OK


def _cmd_report(args) -> int:
    from trainer.report import write_report

    for path in write_report(args.runs, args.out, note=lambda n: print(n, file=sys.stderr)):
        print(path)
    return ExitCode.OK


def _cmd_data(args) -> int:
    if args.action == "pack":
        return _cmd_pack(args)
    if args.overrides:
        raise UsageError(f"trainer data tokenize takes no key=value settings ({args.overrides[0]})")
    if not 0 < args.test_fraction < 1:
        raise UsageError(f"--test-fraction {args.test_fraction}: must be > 0 and < 1, e.g. 0.1")
    from trainer.datasets.tokens import write_token_files

    write_token_files(
        args.src,
        args.out,
        tokenizer=args.tokenizer,
        test_fraction=args.test_fraction,
        split_seed=args.split_seed,
    )
    return ExitCode.OK


def _cmd_pack(args) -> int:
    from trainer.config import load
    from trainer.datasets.pack import pack, source_overrides

    bad = [o for o in args.overrides if not (o.startswith("data.") or o.startswith("seed="))]
    if bad:
        raise UsageError(
            f"trainer data pack: {bad[0]} is not a data.* setting (or seed=): pack reads the "
            "source dataset's settings only"
        )
    cfg = load(None, [*source_overrides(args.src), *args.overrides])
    shuffle = None if args.keep_order else args.shuffle_seed
    pack(cfg.data, cfg.seed, args.out, shard_mb=args.shard_mb, shuffle_seed=shuffle)
    print(f"packed: train with data.name=shards data.shards.path={args.out}")
    return ExitCode.OK


def _cmd_diagnose(args) -> int:
    from trainer.diagnostics import diagnose

    print(diagnose(args.run_dir))
    return ExitCode.OK


def entry() -> int:
    """The process's own entry point (the `trainer` script, `python -m trainer`): main() with the
    garbage collector off while it imports (trainer/startup.py)."""
    from trainer import startup

    startup.begin()
    try:
        return main()
    finally:
        startup.end()


def main(argv: list[str] | None = None) -> int:
    """The `trainer` command (argv None: sys.argv); from Python it leaves the collector alone."""
    try:
        code = _main(argv)
    except SystemExit as e:  # argparse: usage errors (2) and --help (0)
        record_exit(e.code if isinstance(e.code, int) else ExitCode.ERROR)
        raise
    except BrokenPipeError:  # `trainer config explain | head`: the reader had enough
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush must not fail
        return 128 + 13  # as a shell reports SIGPIPE, silently
    except BaseException:  # a bug: keep the traceback, but let the launcher know
        record_exit(ExitCode.ERROR)
        raise
    record_exit(code)
    return code


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The subcommand's arguments; key=value overrides may come before or after its options."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)  # argparse alone cannot interleave them
    if extra and args.command == "export" and not any(a.startswith("-") for a in extra):
        paths = [args.src, *extra]
        there = [p for p in paths if os.path.exists(p)]
        order = (
            f"trainer export {there[0]} -o {next(p for p in paths if p != there[0])}"
            if len(there) == 1 and len(paths) == 2
            else "trainer export SRC -o OUT"
        )
        parser.error(
            f"export takes one source; the output folder goes after -o: {order} "
            f"(got {' '.join(paths)})"
        )
    if extra:
        bad = [
            a for a in extra if a.startswith("-") or "=" not in a or not hasattr(args, "overrides")
        ]
        if bad:
            parser.error(f"unrecognized arguments: {' '.join(bad)}")
        args.overrides = [*args.overrides, *extra]
    return args


def _main(argv: list[str] | None) -> int:
    args = parse(argv)
    if args.command not in ("train", "eval", "export"):  # short: no setup to speed up
        from trainer import startup

        startup.settle()
    try:
        return int(args.func(args))
    except TrainerError as e:  # one line (rank 0's alone where every rank has the same)
        return report(e)
