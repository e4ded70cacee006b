"""Config: precedence, every error path (one line, exit 2, the fix named), round trip."""

import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT, env
from trainer import cli, config
from trainer.config.load import MAX_ERROR_LINE
from trainer.errors import UsageError


def test_defaults_are_the_digits_mlp_preset():
    cfg = config.load()
    assert cfg.name == "digits-mlp"
    assert cfg.data.name == "digits" and cfg.model.name == "mlp"
    assert cfg.run_dir is None  # a new folder runs/<name>/<date-time> per run (trainer.rundir)


def test_precedence_preset_then_file_then_cli(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text("preset: digits-lenet\nname: mine\noptim:\n  lr: 0.05\ntrain:\n  epochs: 3\n")
    cfg = config.load(str(f), ["train.epochs=7", "data.global_batch_size=32"])
    assert cfg.model.name == "lenet"  # from the preset the file builds on
    assert cfg.optim.lr == 0.05  # file beats preset
    assert cfg.train.epochs == 7  # CLI beats file
    assert cfg.data.global_batch_size == 32
    assert cfg.name == "mine" and cfg.run_dir is None


def test_named_preset_and_run_dir_round_trip(tmp_path):
    cfg = config.load("digits-lenet", ["seed=5", "model.hidden=[8,4]"])
    (tmp_path / "config.yaml").write_text(config.to_yaml(cfg))
    again = config.load(str(tmp_path))  # a run directory re-runs its config.yaml
    assert again == cfg


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (
            ["optim.lrr=1"],
            ["unknown key 'optim.lrr'", "did you mean 'optim.lr'", "valid keys here: name, lr"],
        ),
        (["seeed=1"], ["unknown key 'seeed'", "did you mean 'seed'"]),
        (["train.epochs=abc"], ["train.epochs", "abc", "Integer"]),
        (
            ["dist.strategy=ddpp"],
            ["dist.strategy", "did you mean 'ddp'", "auto, none, ddp, fsdp, dp"],
        ),
        (["optim.name=adamm"], ["optim.name", "did you mean 'adam'"]),
        (["model.name=lenett"], ["model.name", "did you mean 'lenet'", "lenet, mlp"]),
        (["data.name=digitz"], ["data.name", "did you mean 'digits'"]),
        (["model.name=:factory"], ["package.module:factory"]),
        (["optim.lr=-1"], ["optim.lr", "> 0"]),
        (["data.global_batch_size=0"], ["data.global_batch_size", "> 0"]),
        (["optim.betas=[0.9]"], ["optim.betas", "two values"]),
        (["optim.name=sgd", "optim.fused=true"], ["optim.fused=true is for adam and adamw"]),
        (["lr"], ["key=value"]),
    ],
)
def test_bad_overrides_name_the_key_and_the_fix(overrides, fragments):
    with pytest.raises(UsageError) as e:
        config.load(None, overrides)
    msg = str(e.value)
    assert "\n" not in msg
    for frag in fragments:
        assert frag in msg


def test_a_bool_key_in_a_file_or_values_is_true_false_or_null_where_optional(tmp_path):
    """OmegaConf takes 2 or the string "yes" for true; a config file or trainer.fit's values
    may not (the command line checks the same words as text)."""
    for text, key, shown in [
        ("optim: {fused: 2}", "optim.fused", "2 is not true or false or null"),
        ('data: {shuffle: "yes"}', "data.shuffle", "'yes' is not true or false ("),
    ]:
        path = tmp_path / "bad.yaml"
        path.write_text(text + "\n")
        with pytest.raises(UsageError, match=re.escape(f"{path}: {key}: {shown}")):
            config.load(str(path))
    with pytest.raises(UsageError, match=re.escape("values: train.compile: 'on' is not true")):
        config.load(None, values={"train": {"compile": "on"}})
    path.write_text("data: {shuffle: 0}\noptim: {fused: null}\ntrain: {compile: true}\n")
    cfg = config.load(str(path))
    assert (cfg.data.shuffle, cfg.optim.fused, cfg.train.compile) == (False, None, True)


def test_bad_config_sources(tmp_path):
    with pytest.raises(UsageError, match="neither a preset .*did you mean 'digits-mlp'"):
        config.load("digits-mpl")
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: [unclosed\n")
    with pytest.raises(UsageError, match="not valid YAML"):
        config.load(str(bad))
    lst = tmp_path / "list.yaml"
    lst.write_text("- a\n- b\n")
    with pytest.raises(UsageError, match="must be a YAML mapping"):
        config.load(str(lst))
    typo = tmp_path / "typo.yaml"
    typo.write_text("optim:\n  lrr: 1\n")
    with pytest.raises(UsageError, match=f"{typo}: unknown key 'optim.lrr'"):
        config.load(str(typo))


YAML_MISTAKES = [
    # (the file, line:column, the parser's problem, the fix)
    (
        "optim:\n  lr: 0.1\n  momentum: 0.9\n  lr: 0.2\n",
        "4:3",
        "found duplicate key 'lr'",
        "remove one of the two 'lr:' lines (2 and 4)",
    ),
    ("lr: 1\nlr: 2\n", "2:1", "found duplicate key 'lr'", "remove one of the two 'lr:' lines"),
    ("optim: {lr: 1, lr: 2}\n", "1:16", "found duplicate key 'lr'", "entries (at 1:9 and 1:16)"),
    ("optim: {lr: 0.1\n", "2:1", "did not find expected ',' or '}'", "close the '{' at 1:8"),
    ("optim: [unclosed\n", "2:1", "did not find expected ',' or ']'", "close the '[' at 1:8"),
    (
        "optim: {lr: 0.1 momentum: 0.9}\n",
        "1:25",
        "did not find expected ',' or '}'",
        "put a ',' between the items of the '{' at 1:8",
    ),
    ("model:\n  hidden: [8,,4]\n", "2:14", "expected node content", "remove that ','"),
    ("optim:\n\tlr: 1\n", "2:1", "cannot start any token (a tab)", "indent with spaces"),
    ("optim:\n    lr: 1\n  momentum: 0.9\n", "3:3", "did not find expected key", "indent the"),
    (
        "optim:\n  lr 0.1\n  momentum: 0.9\n",
        "3:11",
        "mapping values are not allowed",
        "line 2 ('lr 0.1') has no ':'",
    ),
    ("name: a: b\n", "1:8", "mapping values are not allowed", "quote a value that holds ': '"),
    ('name: "abc\nseed: 1\n', "3:1", "unexpected end of stream", "close the quote opened at 1:7"),
    ("optim: {lr: 1}}\n", "1:15", "did not find expected key", "remove that '}'"),
    ("name: a\n---\nseed: 1\n", "2:1", "another document", "remove that '---'"),
    ("name: @x\n", "1:7", "cannot start any token ('@')", "quote the value"),
    ("name: a\x07b\n", "1:8", "unacceptable character #x0007", "delete that character"),
]


@pytest.mark.parametrize("text, where, problem, fix", YAML_MISTAKES)
def test_a_yaml_mistake_names_its_line_and_column_the_problem_and_the_fix(
    tmp_path, text, where, problem, fix
):
    f = tmp_path / "my.yaml"
    f.write_text(text)
    with pytest.raises(UsageError) as e:
        config.load(str(f))
    msg = str(e.value)
    assert msg.startswith(f"{f}:{where}: not valid YAML: "), msg
    assert problem in msg and fix in msg and "\n" not in msg, msg


@pytest.mark.parametrize(
    "override, says",
    [
        (
            "optim.betas=[0.9, 0.99",  # the shell split `optim.betas=[0.9, 0.99 ]`
            "cannot parse '[0.9, 0.99' at the end: did not find expected ',' or ']': close the "
            "'[' at character 1 with ']'; the shell splits an override at a space unless it is "
            "quoted",
        ),
        ("model.hidden=[1,,2]", "at character 4: did not find expected node content: remove"),
        ("name={a: 1, a: 2}", "found duplicate key 'a': remove one of the two 'a:' entries"),
        ("name=@x", "at character 1: found character that cannot start any token ('@'): quote"),
        ("name='abc", "at the end: found unexpected end of stream: close the quote opened at"),
    ],
)
def test_a_yaml_mistake_in_an_override_names_where_in_the_value_and_the_fix(override, says):
    with pytest.raises(UsageError) as e:
        config.load(None, [override])
    key = override.partition("=")[0]
    assert str(e.value).startswith(f"command line: {key}: ") and says in str(e.value), e.value


X = "x" * 100_000


@pytest.mark.parametrize(
    "overrides",
    [
        [f"{'a' * 100_000}=1"],  # a key: was echoed whole (100,152 characters)
        [f"optim.{'a' * 100_000}=1"],
        [f"optim.lr.x{'a' * 100_000}=1"],
        [f"a b{'a' * 100_000}=1"],
        ["a" * 100_000],
        [f"seed={X}"],  # values
        [f"optim.lr={X}"],
        [f"optim.name={X}"],
        [f"data.name={X}"],
        [f"dist.strategy={X}"],
        [f"train.compile={X}"],
        [f"model.hidden=[{X}]"],
        [f"name={{{X}: 1}}"],
        [f"optim.lr=[{X}"],
        ["optim.lr=\udcff" + X],
        ["optim.betas=[" + ",".join(["0.9"] * 9000) + "]"],
    ],
)
def test_an_error_line_shortens_what_the_user_typed(overrides):
    with pytest.raises(UsageError) as e:
        config.load(None, overrides)
    msg = str(e.value)
    assert len(msg) <= MAX_ERROR_LINE and "\n" not in msg, msg[:1000]
    assert "characters" in msg or "bytes" in msg, msg  # says how long it was


def test_a_long_key_in_a_yaml_file_or_config_explain_is_shortened(tmp_path):
    f = tmp_path / "dup.yaml"
    f.write_text(f"{'k' * 1000}: 1\n{'k' * 1000}: 2\n")
    with pytest.raises(UsageError) as e:
        config.load(str(f))
    assert len(str(e.value)) <= MAX_ERROR_LINE and f"{f}:2:1:" in str(e.value)
    assert "(1,000 characters)" in str(e.value)
    from trainer.config.explain import explain

    with pytest.raises(UsageError) as e:
        explain(config.load(), ["a" * 100_000])
    assert len(str(e.value)) <= 200 and "(100,000 characters)" in str(e.value)


def test_a_list_past_omegaconfs_limit_says_the_limit_and_what_to_do():
    items = ",".join(["1"] * 20_000)
    with pytest.raises(UsageError) as e:
        config.load(None, [f"model.hidden=[{items}]"])
    assert str(e.value) == (
        "command line: model.hidden: a list of 20,000 items, past the 10,000 values one override "
        "may hold (OmegaConf's guard against YAML alias bombs): model.hidden takes a few (e.g. "
        "model.hidden=[256,128]): give the ones it needs"
    )
    with pytest.raises(UsageError) as e:
        config.load(None, [f"data.kwargs.weights=[{items}]"])
    assert "past the 10,000 values" in str(e.value) and "in a file and pass its path" in str(
        e.value
    )


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "trainer", *args],
        capture_output=True,
        text=True,
        env=env(),
        cwd=ROOT,
        timeout=60,
    )


def test_cli_config_error_is_one_line_exit_2_no_traceback():
    p = _cli("train", "optim.lrr=0.1")
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0
    assert "Traceback" not in p.stderr and "did you mean 'optim.lr'" in p.stderr
    p = _cli("train", "--nope")
    assert p.returncode == 2 and "unrecognized arguments: --nope" in p.stderr


def test_config_check_knows_the_world_size():
    p = _cli("config", "check", "--world-size=4", "data.global_batch_size=6")
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0, p.stderr
    assert "data.global_batch_size=6 does not split over 4 ranks" in p.stderr
    assert "e.g. data.global_batch_size=4 or 8" in p.stderr
    p = _cli("config", "check", "--world-size=4", "data.global_batch_size=8")
    assert p.returncode == 0 and "config ok" in p.stdout


def test_cli_config_show_accepts_overrides_after_options():
    p = _cli(
        "config", "show", "--config", "digits-lenet", "optim.lr=0.5", "model.activation=sigmoid"
    )
    assert p.returncode == 0, p.stderr
    assert "lr: 0.5" in p.stdout and "activation: sigmoid" in p.stdout and "name: lenet" in p.stdout
    assert set(_cli("config", "list").stdout.split()) >= {"digits-mlp", "digits-lenet"}


def test_help_does_not_import_torch():
    code = (
        "import sys\nfrom trainer.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "bad = [m for m in ('torch', 'omegaconf', 'numpy') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    p = _python(code)
    assert p.returncode == 0, p.stderr
    assert "train" in p.stdout and "exit codes" in p.stdout


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env(), cwd=ROOT
    )


def test_importing_the_package_does_no_work():
    code = (
        "import os, sys\nos.environ.clear()\nimport trainer, trainer.config, trainer.cli, trainer.registry\n"
        "assert 'torch' not in sys.modules\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env(), cwd=ROOT
    )
    assert p.returncode == 0, p.stderr


def test_each_rank_leaves_its_exit_code_for_the_launcher(tmp_path):
    from trainer.exitstatus import node_exit_code, node_message

    for rank, args in (("0", ["config", "check", "optim.lrr=1"]), ("1", ["train", "--bogus"])):
        p = subprocess.run(
            [sys.executable, "-m", "trainer", *args],
            capture_output=True,
            text=True,
            env=env(TRAINER_STATUS_DIR=str(tmp_path), RANK=rank, TORCHELASTIC_RESTART_COUNT="2"),
            cwd=ROOT,
            timeout=60,
        )
        assert p.returncode == 2
    assert sorted(f.name for f in tmp_path.iterdir()) == [
        "attempt-2.rank-0.exit",
        "attempt-2.rank-0.msg",  # the line it printed, for trainer-launch to print last, once
        "attempt-2.rank-1.exit",
    ]
    assert node_exit_code(str(tmp_path), 1) == 2
    assert node_message(str(tmp_path), 2).startswith("trainer: error: command line: unknown key")
    assert node_message(str(tmp_path), 4) is None
    assert node_exit_code(str(tmp_path / "missing"), 1) == 1


def _codes(folder, **codes):
    for name, code in codes.items():
        (folder / f"{name.replace('_', '.')}.exit").write_text(f"{code}\n")


def test_the_node_reports_the_root_cause_of_the_last_attempt(tmp_path):
    from trainer.exitstatus import node_exit_code

    # attempt 0 had a config-looking failure; the last attempt (1) only a transient one
    _codes(tmp_path, **{"attempt-0_rank-0": 2, "attempt-1_rank-1": 4})
    assert node_exit_code(str(tmp_path), 1) == 4
    # a bug on one rank outranks its peers' timeouts
    _codes(tmp_path, **{"attempt-1_rank-0": 1})
    assert node_exit_code(str(tmp_path), 1) == 1


def test_preempted_counts_only_when_the_node_itself_was_signalled(tmp_path):
    from trainer.exitstatus import node_exit_code

    # A rank was OOM-killed (no file); torchrun SIGTERMed the other, which checkpointed: 3.
    _codes(tmp_path, **{"attempt-0_rank-1": 3})
    assert node_exit_code(str(tmp_path), 1) == 1  # not a preemption: let backoffLimit count it
    assert node_exit_code(str(tmp_path), 143, signalled=True) == 3
    _codes(tmp_path, **{"attempt-0_rank-0": 4})
    assert node_exit_code(str(tmp_path), 143, signalled=True) == 4


def test_a_stop_by_signal_leaves_its_line_on_every_node(tmp_path, monkeypatch, capsys):
    """Rank 0 alone prints `trainer: stopped by ...`, but ranks on other nodes leave it for their
    node's launcher too: else node 1 (a Slurm node, a pod) ends with torchrun's traceback."""
    from trainer import exitstatus
    from trainer.errors import Preempted

    monkeypatch.setattr(exitstatus, "RANK0_GRACE_S", 0)
    monkeypatch.setenv(exitstatus.STATUS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "2")
    stop = Preempted("stopped by SIGTERM at step 6; checkpoint c saved: rerun to resume")
    assert exitstatus.report(stop) == 3 and capsys.readouterr().err == ""
    exitstatus.record_exit(3)
    assert exitstatus.node_message(str(tmp_path), 3) == f"trainer: {stop}"


# --- trainer config explain: the schema's own docstrings, from the CLI ------------------------


def test_every_key_and_section_has_a_description():
    from trainer.config import schema
    from trainer.config.explain import doc

    assert [f.key for f in schema.fields() if not doc(f)] == []


def test_explain_reads_the_docstring_under_each_field_in_schema_py():
    import inspect

    from trainer.config import schema
    from trainer.config.explain import attribute_docs

    source = inspect.getsource(schema.OptimConfig)
    docs = attribute_docs(schema.OptimConfig)
    assert docs["lr"] == "Peak learning rate." and '"""Peak learning rate."""' in source
    assert set(docs) == {f.name for f in schema.dataclasses.fields(schema.OptimConfig)}


def test_config_explain_a_key_says_type_range_default_resolved_value_and_meaning(capsys):
    from trainer import cli

    code = cli.main(
        ["config", "explain", "optim.lr", "repro.shards", "--config", "digits-lenet", "seed=3"]
    )
    out = capsys.readouterr().out
    assert code == 0
    first, *rest = out.split("\n\n")[0].splitlines()
    assert first == "optim.lr: float = 0.003  (default 0.001)"  # digits-lenet sets 0.003
    assert rest == ["  range: > 0 and <= 10", "  Peak learning rate."]
    assert "repro.shards: int = 8\n  range: > 0 and <= 2**16\n  Shards per global batch" in out


def test_config_explain_a_section_lists_its_keys_and_no_key_lists_the_sections(capsys):
    from trainer import cli
    from trainer.config import schema

    assert cli.main(["config", "explain", "sched", "sched.name=cosine"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("sched: The learning-rate schedule")
    keys = [f.key for f in schema.walk(schema.SchedConfig, "sched.")]
    assert [line.split()[0] for line in out[1:]] == keys
    assert out[1].split()[:3] == ["sched.name", "=", "cosine"]
    assert cli.main(["config", "explain"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]]
    assert listed == [f.key for f in schema.walk(nested=False)]


def test_a_closed_pipe_ends_the_command_quietly():
    # `trainer config explain | head -3`: head exits, the next write raises BrokenPipeError.
    code = (
        "import sys\n"
        "from trainer.config import explain\n"
        "def gone(*a):\n"
        "    raise BrokenPipeError(32, 'Broken pipe')\n"
        "explain.explain = gone\n"
        "from trainer import cli\n"
        "sys.exit(cli.main(['config', 'explain', 'optim']))\n"
    )
    p = _python(code)
    assert (p.returncode, p.stderr) == (141, "")


@pytest.mark.parametrize(
    "argv",
    [
        ["config", "check", "-" + "a" * 100_000],  # unrecognized arguments: echoed by argparse
        ["config", "check", "--world-size=" + "x" * 100_000],  # invalid int value: 'xxx...'
    ],
)
def test_argparse_errors_shorten_a_huge_argument(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1, err[:300]
    assert len(err) < 300 and "(100,0" in err and "characters)" in err, err[:300]


def test_a_ranks_error_line_is_one_write_with_its_newline(monkeypatch):
    """Two ranks' lines on one terminal ran together ("...model.name=gpt trainer: error: ..."):
    print() wrote the line and its newline apart, so another rank's line came between."""
    import io

    from trainer import exitstatus
    from trainer.errors import UsageError

    class Writes(io.StringIO):
        def __init__(self):
            super().__init__()
            self.calls = []

        def write(self, s):
            self.calls.append(s)
            return super().write(s)

    stderr = Writes()
    monkeypatch.setattr(sys, "stderr", stderr)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv(exitstatus.STATUS_DIR_ENV, raising=False)
    e = UsageError("rank 1: model.name=gpt needs data.name=text")  # every rank reports it
    assert exitstatus.report(e) == 2
    assert stderr.calls == [f"trainer: error: {e}\n"]
