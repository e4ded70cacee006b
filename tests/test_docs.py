"""Docs that cannot drift: every measured number they quote is checked against the one place it
comes from (bench/results, the test harness's constants, the code), every install line names our
distribution, and the cheap shell examples of the README and docs/ run here (config commands
in full, launcher commands as --dry-run), the README's example error with the output it shows."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
from importlib import metadata

import pytest

from tests.engine import DISK_NEEDED
from tests.helpers import ROOT
from trainer import cli
from trainer.errors import ExitCode

README = (ROOT / "README.md").read_text()
DOCS = {p.name: p.read_text() for p in (ROOT / "docs").glob("*.md")}
BENCH = json.loads((ROOT / "bench" / "results" / "cpu-cpu.json").read_text())
RATIOS = BENCH["ratios"]
ROWS = {r["name"]: r for r in BENCH["rows"]}


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    following = re.search(r"\n#{1,3} ", text[start + len(heading) :])
    return text[start : start + len(heading) + following.start()] if following else text[start:]


def _table(text: str) -> list[list[str]]:
    """The body rows of every Markdown table in `text`, as cells."""
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not re.match(r"^\|[-:| ]+\|$", line):
            rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def _shown(value: float, unit: str) -> str:
    return {"samples/s": f"{value:,.0f}", "x": f"{value:.3f}"}.get(unit, f"{value:.2f}")


def _check_ratio(cells: list[str], r: dict) -> None:
    name = cells[0]
    assert cells[1] == f"{r['value']:.3f}", (name, cells)
    assert cells[2] == f"{r['per_rep_min']:.3f}-{r['per_rep_max']:.3f}", (name, cells)
    paired = f"{r['paired']:.3f} [{r['ci90_lo']:.3f}-{r['ci90_hi']:.3f}]"
    assert cells[3] == paired, (name, cells)
    assert cells[4] == (f">= {r['target']:.2f}" if r["target"] else ""), (name, cells)


def test_the_measured_tables_in_docs_benchmarks_are_the_committed_results():
    """The CPU suite's tables (cpu-cpu.json), then the alternating rows' 8-repetition run
    (alternating-cpu.json)."""
    measured = _section(DOCS["benchmarks.md"], "### Measured here")
    suite, alternating = measured.split("`bench/results/alternating-cpu.json`")
    checked = 0
    for cells in _table(suite):  # rows: name, median, range; ratios: + paired, target
        name = cells[0].strip("`")
        if len(cells) == 3 and name in ROWS:
            row = ROWS[name]
            unit = row["unit"]
            suffix = "" if unit == "x" else f" {unit}"  # a ratio row (interleaved)
            assert cells[1] == f"{_shown(row['median'], unit)}{suffix}", (name, cells)
            assert cells[2] == f"{_shown(row['min'], unit)}-{_shown(row['max'], unit)}", cells
            checked += 1
        elif len(cells) == 5 and name in RATIOS:
            _check_ratio(cells, RATIOS[name])
            checked += 1
    assert checked == len(ROWS) + len(RATIOS)  # every row and ratio, none left out
    eight = json.loads((ROOT / "bench" / "results" / "alternating-cpu.json").read_text())
    quoted = {cells[0]: cells for cells in _table(alternating) if len(cells) == 5}
    assert eight["reps"] == 8 and set(eight["ratios"]) <= set(quoted)
    for name, r in eight["ratios"].items():
        _check_ratio(quoted[name], r)


def test_the_readme_quotes_the_committed_ratios():
    """The CPU suite's ratios, and world_invariant / plain from the invariant suite."""
    table = _table(_section(README, "## Benchmarks"))
    quoted = {float(n) for cells in table[1:] for n in re.findall(r"\d+\.\d\d", cells[1])}
    rounded = lambda x: round(x, 2)  # noqa: E731
    invariant = json.loads((ROOT / "bench" / "results" / "invariant-cpu.json").read_text())
    wi = [invariant["ratios"][f"world_invariant / plain, world {w}"] for w in (1, 2)]
    measured = [*RATIOS.values(), *wi]
    every = {rounded(r[k]) for r in measured for k in ("value", "per_rep_min", "per_rep_max")}
    assert quoted <= every, sorted(quoted - every)  # nothing quoted that was not measured
    assert {rounded(r["value"]) for r in measured} <= quoted  # and every ratio quoted


def test_docs_training_quotes_the_world_invariant_cost_of_the_committed_run():
    found = re.search(
        r"world_invariant / plain throughput (\d\.\d\d) at 1 process and (\d\.\d\d) at 2",
        DOCS["training.md"],
    )
    assert found, "docs/training.md no longer states the cost"
    invariant = json.loads((ROOT / "bench" / "results" / "invariant-cpu.json").read_text())
    ratios = invariant["ratios"]
    assert float(found[1]) == round(ratios["world_invariant / plain, world 1"]["value"], 2)
    assert float(found[2]) == round(ratios["world_invariant / plain, world 2"]["value"], 2)


def test_the_disk_that_test_image_needs_is_quoted_as_the_harness_checks_it():
    needed = f"{DISK_NEEDED / 1e9:.0f} GB"
    makefile = (ROOT / "Makefile").read_text()
    for name, text in [("README.md", README), ("Makefile", makefile)]:
        assert f"{needed} free disk" in text or f"{needed} of free disk" in text, name
    assert f"less than {needed} free" in DOCS["containers.md"]


def test_the_exit_code_table_has_every_code_the_commands_use():
    table = _table(_section(DOCS["training.md"], "### Exit codes"))
    codes = {cells[0]: cells[1] for cells in table[1:]}
    assert {str(int(c)) for c in ExitCode} <= codes.keys()
    assert "NaN" in codes["2"] and "NaN" in cli.EXIT_CODES  # a diverged run: exit 2
    assert "128+N" in codes and "trainer-launch" in codes["128+N"]


def test_every_install_line_names_our_distribution():
    ours = "repro-trainer"  # PyPI's `trainer` is another project
    assert metadata.metadata(ours)["Name"] == ours  # what pyproject.toml names and pip installed
    assert re.search(rf'^name = "{ours}"$', (ROOT / "pyproject.toml").read_text(), re.M)
    sources = {"README.md": README, **DOCS}
    for path in (ROOT / "trainer").rglob("*.py"):
        sources[str(path.relative_to(ROOT))] = path.read_text()
    lines = [
        (name, m[0])
        for name, text in sources.items()
        for m in re.finditer(r"pip install '?([\w.-]+)\[[\w,]+\]'?", text)
    ]
    assert lines  # the extras are mentioned somewhere
    wrong = [(name, line) for name, line in lines if f"install '{ours}[" not in line]
    assert not wrong, wrong


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def _doc_commands() -> list[tuple[str, str]]:
    """(page, command) for every line of a shell block (```bash, sh, console) in the README and
    docs/*.md: a continued line joined, a `$ ` prompt and a trailing ` # comment` dropped."""
    found = []
    for page, text in {"README.md": README, **{f"docs/{n}": t for n, t in DOCS.items()}}.items():
        for block in re.findall(r"```(?:bash|sh|console)\n(.*?)```", text, re.S):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                found.append((page, _command(line)))
    return found


def _command(line: str) -> str:
    return re.split(r"\s#\s", line.strip().removeprefix("$ "))[0].strip()


def _shell_commands(prefix: str) -> list[tuple[str, str]]:
    """(page, command) for every command of the docs' shell blocks that starts with `prefix`."""
    return [(page, c) for page, c in _doc_commands() if c.startswith(prefix)]


CONFIG_COMMANDS = _shell_commands("trainer config ")
LAUNCH_COMMANDS = [(p, c) for p, c in _shell_commands("trainer-launch") if " -- " not in c]


def test_the_docs_hold_examples_of_both_kinds():
    pages = {page for page, _ in CONFIG_COMMANDS}
    assert "README.md" in pages and len(CONFIG_COMMANDS) >= 3, CONFIG_COMMANDS
    assert len(LAUNCH_COMMANDS) >= 2, LAUNCH_COMMANDS


@pytest.mark.parametrize("page, command", CONFIG_COMMANDS)
def test_the_docs_config_examples_run(page, command):
    code, out, err = _run(shlex.split(command)[1:])
    assert code == 0, f"{page}: {command}: {err}"
    assert out.strip()


@pytest.mark.parametrize("page, command", LAUNCH_COMMANDS)
def test_the_docs_launcher_examples_resolve_to_a_torchrun_command(page, command, monkeypatch):
    """Each `trainer-launch ...` example, as --dry-run: its arguments are valid and it would
    start torchrun (a foreign executable, `trainer-launch bash`, would run as is)."""
    from trainer.launch import launcher

    for name in ("NNODES", "NODE_RANK", "MASTER_ADDR", "TRAIN_ARGS", "PET_NNODES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NPROC_PER_NODE", "2")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()) as err:
        code = launcher.main(["--dry-run", *shlex.split(command)[1:]])
    assert code == 0, f"{page}: {command}: {err.getvalue()}"
    line = out.getvalue().strip().splitlines()[-1]
    if shlex.split(command)[1:2] == ["bash"]:
        assert line.split()[-1] == "bash" and "torch.distributed.run" not in line, line
    else:
        assert "-m torch.distributed.run" in line and line.endswith(
            " ".join(["-m trainer train", *shlex.split(command)[1:]])
        ), line


def test_the_readmes_example_error_is_what_the_command_prints(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    shown = re.search(r"```\n\$ (trainer .*)\n(trainer: error: .*)\n```", README)
    assert shown, "the README's example error is gone"
    code, _, err = _run(shlex.split(shown[1])[1:])
    assert code == 2 and err.strip() == shown[2]
    assert not list(tmp_path.iterdir())  # refused before anything was written


def test_the_gpu_ratios_in_docs_benchmarks_are_the_committed_results():
    measured = _section(DOCS["benchmarks.md"], "### Measured on an H100")
    results = ROOT / "bench" / "results"
    runs = [json.loads((results / f"gpu-nvidia-h100-80gb-hbm3{s}.json").read_text())
            for s in ("", "-compile-rerun")]  # fmt: skip
    full = runs[0]["ratios"]
    rows = [cells for cells in _table(measured) if cells[0] in full]
    assert len(rows) == len(full)
    for name, value, spread, target in rows:
        r = full[name]
        assert value == f"{r['value']:.3f}", name
        assert spread == f"{r['per_rep_min']:.3f}-{r['per_rep_max']:.3f}", name
        assert target == (f">= {r['target']:.2f}" if r["target"] else ""), name
    text = " ".join(measured.split())
    rerun = runs[1]["ratios"]["trainer / bare loop, bf16+cl+compile"]
    assert f"{rerun['value']:.3f} ({rerun['per_rep_min']:.3f}-{rerun['per_rep_max']:.3f})" in text
    median = {(i, r["name"]): r["median"] for i, run in enumerate(runs) for r in run["rows"]}
    quoted = [
        (0, "bare loop fp32"),
        (0, "trainer bf16 + channels_last"),
        (1, "trainer bf16 + channels_last + compile"),
        (1, "trainer bf16 + channels_last"),
    ]
    for key in quoted:
        assert f"{median[key]:,.0f}" in text, key
    mfu = next(r["mfu_bf16"] for r in runs[0]["rows"] if r["name"] == quoted[1][1])
    assert f"MFU {mfu:.1%}" in text


def test_the_checkpoint_stall_tables_in_docs_benchmarks_are_the_committed_results():
    measured = _section(DOCS["benchmarks.md"], "### Checkpoint stall, measured here")
    ckpt = json.loads((ROOT / "bench" / "results" / "ckpt-cpu.json").read_text())
    rows, ratios = {r["name"]: r for r in ckpt["rows"]}, ckpt["ratios"]
    checked = 0
    for cells in _table(measured):
        if cells[0] in rows:
            r = rows[cells[0]]
            assert cells[1:] == [f"{r['median']:.2f} s", f"{r['min']:.2f}-{r['max']:.2f}"], cells
        elif cells[0] in ratios:
            r = ratios[cells[0]]
            spread = f"{r['per_rep_min']:.3f}-{r['per_rep_max']:.3f}"
            assert cells[1:] == [f"{r['value']:.3f}", spread, f"<= {r['target']:.2f}"], cells
        else:
            continue
        checked += 1
    assert checked == len(rows) + len(ratios)


def test_the_size_sweep_table_in_docs_benchmarks_is_the_committed_result():
    measured = _table(_section(DOCS["benchmarks.md"], "### Cost against size, measured here"))
    sweep = json.loads((ROOT / "bench" / "results" / "sweep-cpu.json").read_text())
    expected = []
    for size in sweep["sizes"]:
        for world in (1, 2):
            x = size[f"world_{world}"]
            ms = {k: x[k] * 1000 for k in ("step_s", "data_wait_s", "stall_per_save_s", "write_s")}
            expected.append([
                str(size["width"]), f"{size['params']:,}", str(world), f"{x['tokens_per_s']:,.0f}",
                f"{ms['step_s']:.0f} ms", f"{ms['data_wait_s']:.2f} ms",
                f"{ms['stall_per_save_s']:.0f} ms", f"{ms['write_s']:.0f} ms",
            ])  # fmt: skip
    assert measured[1:] == expected
    params = [s["params"] for s in sweep["sizes"]]
    assert len(params) >= 3 and params[-1] >= 10 * params[0]  # at least a 10x range of sizes


# --- every training command the docs and the scripts' headers show ------------------------------

_ENTRY = re.compile(
    r"(?:^|\s)(?:trainer train|-m trainer train|slurm/\S+\.sbatch|trainer-launch)(?=\s|$)"
)
_PLACEHOLDERS = (
    "...", "…", " NAME", "=NAME", "PATH", "path/to", "[k=v", "[--", "my.yaml", "runs/local-",
    "runs/digits",
)  # fmt: skip
"""A command holding one of these is a pattern, not a command (`--config NAME`, `[k=v ...]`) or
names a run folder of the reader's own (`--config runs/...`)."""


def _training_commands() -> list[tuple[str, str, str]]:
    """(where, command, its trainer arguments) for every line of a bash block in the README and
    docs/*.md, and every `#   command` line of a script's header (slurm/*, docker/*, scripts/*),
    that starts training: `trainer train`, `torchrun ... -m trainer train`, `sbatch
    slurm/...sbatch`, `trainer-launch` (a continued line joined, a trailing comment dropped).
    Left out: patterns and runs of the reader's own (_PLACEHOLDERS, --resume, --dry-run) and
    trainer-launch running another program (`-- python ...`, `bash`)."""
    found = _doc_commands()
    for path in sorted([*ROOT.glob("slurm/*"), *ROOT.glob("docker/*"), *ROOT.glob("scripts/*")]):
        if path.is_file():
            for line in path.read_text(errors="replace").splitlines():
                if line.startswith("#   "):
                    found.append((str(path.relative_to(ROOT)), _command(line[4:])))
    commands = []
    for where, command in found:
        entry = _ENTRY.search(command)
        if entry is None or command.startswith("#"):
            continue
        args = shlex.split(command[entry.end() :])
        if (
            any(p in command for p in _PLACEHOLDERS)
            or {"--resume", "--dry-run", "--"} & set(args)
            or args == ["bash"]
        ):
            continue
        commands.append((where, command, args))
    return commands


TRAINING_COMMANDS = _training_commands()


def _world_size(command: str) -> int:
    """The world a command asks for: torchrun's --nnodes x --nproc-per-node, sbatch's --nodes x
    --gpus-per-node (the script's default: 2 nodes), 1 otherwise."""

    def get(flag: str, default: int) -> int:
        m = re.search(flag + r"[= ](\d+)", command)
        return int(m.group(1)) if m else default

    if "sbatch" in command:
        return get("--nodes", 2) * get("--gpus-per-node", get("NPROC_PER_NODE", 1))
    return get("--nnodes", 1) * get("--nproc-per-node", 1)


def test_the_docs_and_script_headers_show_training_commands():
    where = {w for w, _, _ in TRAINING_COMMANDS}
    assert {"README.md", "docs/slurm.md", "docs/training.md", "slurm/train.sbatch"} <= where, where
    assert len(TRAINING_COMMANDS) >= 25, TRAINING_COMMANDS


@pytest.mark.parametrize(
    "where, command, args", TRAINING_COMMANDS, ids=[c for _, c, _ in TRAINING_COMMANDS]
)
def test_every_training_command_shown_is_a_valid_config_at_its_world_size(
    where, command, args, monkeypatch
):
    """`trainer config check --world-size=N` on each shown command's trainer arguments (issue 56:
    slurm/train.sbatch's header named a preset that does not exist; docs/data.md resumed a run
    of global batch 128 on 3 ranks). `optim.lrr=0.1` is the README's example of a mistake;
    `log.mlflow.uri=env` reads the variable the page says to set."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    code, _, err = _run(["config", "check", f"--world-size={_world_size(command)}", *args])
    expected = 2 if "optim.lrr=0.1" in args else 0
    assert code == expected, f"{where}: {command}: {err.strip()}"


def test_what_the_slurm_script_and_docs_write_in_the_checkout_is_ignored_by_git():
    """slurm/train.sbatch's log (`--output=%x-%j.out` of job name `train`) and docs/torchx.md's
    `job_dir=jobs/...` land where the user submits, the checkout's root (issue 56 item 7)."""
    import subprocess

    script = (ROOT / "slurm" / "train.sbatch").read_text()
    name = re.search(r"^#SBATCH --job-name=(\S+)", script, re.M).group(1)
    log = re.search(r"^#SBATCH --output=(\S+)", script, re.M).group(1)
    job_dir = re.search(r"job_dir=(\S+)", DOCS["torchx.md"]).group(1)
    paths = [log.replace("%x", name).replace("%j", "4242"), "slurm-4242.out", f"{job_dir}/x"]
    for path in paths:
        ignored = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0
        assert ignored, f"{path} is not in .gitignore"
