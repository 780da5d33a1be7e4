"""--config FILE (issue 54, N6): a run's flags in a TOML or JSON file, keys
the flags' names, the command line's flags over it, every value checked by
its flag, a bad key or value one line naming both; the merged flags in the
final record and each checkpoint (`config`).

    python -m pytest -q tests/test_config_file.py
"""
import json
import os

import pytest

from conftest import REPO, checkpoint_file, checkpoint_path
from hpctrain.flags import cli
from hpctrain.base.errors import HpctrainError


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def refused(*argv):
    with pytest.raises(HpctrainError) as e:
        cli.parse(list(argv), quiet=True)
    return str(e.value)


def test_a_toml_file_sets_flags_by_either_spelling_and_the_command_line_overrides_it(tmp_path):
    path = write(tmp_path, "run.toml", 'model = "gpt:layers=2,heads=2,width=32"\nblock-size = 64\nbatch_size = 3\n'
                                       'lr = 1e-3\nadam_betas = [0.9, 0.99]\nrecompute = true\nsteps = 500\n'
                                       'lr_schedule = "cosine"\n')
    args = cli.parse(["--config", path, "--lr", "2e-3"], quiet=True)
    assert (args.block_size, args.batch_size, args.lr, args.adam_betas, args.recompute, args.steps,
            args.lr_schedule) == (64, 3, 2e-3, (0.9, 0.99), True, 500, "cosine")
    assert args.model == "gpt:layers=2,heads=2,width=32" and args.config == path
    # one of two alternatives on the command line beats the file's other
    args = cli.parse([f"--config={path}", "--epochs", "2"], quiet=True)
    assert (args.epochs, cli.configuration(args)["steps"]) == (2.0, None)


def test_json_switches_both_ways_and_null_is_the_default(tmp_path):
    path = write(tmp_path, "ps.json", json.dumps({"mode": "ps", "sync": False, "clip_norm": None, "zero": None}))
    args = cli.parse(["--config", path], quiet=True)
    assert (args.mode, args.sync, args.clip_norm) == ("ps", False, None)
    assert cli.parse(["--config", path, "--sync"], quiet=True).sync is True
    assert cli.parse(["--config", write(tmp_path, "a.json", '{"async": true}')], quiet=True).sync is False


def test_the_recorded_configuration_is_itself_a_config_file_for_the_same_run(tmp_path):
    args = cli.parse(["--model", "gpt:layers=2,heads=2,width=32", "--hidden", "8", "--adam-betas", "0.8,0.9",
                      "--augment", "flip", "--clip-norm", "1", "--async", "--mode", "ps"], quiet=True)
    config = cli.configuration(args)
    path = write(tmp_path, "again.json", json.dumps(config))
    assert cli.configuration(cli.parse(["--config", path], quiet=True)) == config
    assert "config" not in config and set(config) == {a.dest for a in cli.build_parser()._actions} - {
        "help", "help_all", "config"}


@pytest.mark.parametrize("name, text, line", [
    ("a.toml", "lr = -1\n", "--config {}: key 'lr' (--lr): must be > 0, got -1"),
    ("b.toml", "batchsize = 3\n", "--config {}: unknown key 'batchsize' (no flag --batchsize); did you mean "
                                  "'batch_size'?"),
    ("c.toml", "steps = 3\nepochs = 2\n", "--config {}: --epochs: not allowed with argument --steps"),
    ("d.json", '{"lr": true}', "--config {}: key 'lr' (--lr): expected a number or a string, got true"),
    ("e.json", '{"recompute": "yes"}', "--config {}: key 'recompute' (--recompute): expected true or false, "
                                       "got 'yes'"),
    ("f.json", '{"adam-betas": [-0.1, 0.9]}', "--config {}: key 'adam-betas' (--adam-betas): expected B1,B2, "
                                              "each in [0, 1), got '-0.1,0.9'"),
    ("g.json", '{"batch_size": 4, "batch-size": 5}', "--config {}: keys 'batch_size' and 'batch-size' both set "
                                                     "--batch-size"),
    ("h.json", '{"model": {"layers": 2}}', "--config {}: key 'model' (--model): expected a number or a string, "
                                           "got a table"),
    ("i.json", '{"mode": "rings"}', "--config {}: key 'mode' (--mode): invalid choice: 'rings' (choose from "),
    ("j.json", '{"config": "other.json"}', "--config {}: unknown key 'config' (no flag --config)"),
    ("k.json", "[1]", "--config {}: expected an object of settings (keys: the flags' names), got a JSON list"),
    ("l.yaml", "lr: 1", "--config {}: YAML is not read (PyYAML is no dependency of hpctrain); write the same keys "
                        "as TOML (FILE.toml) or JSON (FILE.json)"),
])
def test_a_bad_key_or_value_is_one_line_naming_the_key_and_the_file(tmp_path, name, text, line):
    path = write(tmp_path, name, text)
    message = refused("--config", path)   # argparse's choices are quoted by some Pythons, not others
    assert message.startswith(line.format(path)) and "\n" not in message, message


def test_an_unreadable_or_malformed_file_is_one_line(tmp_path):
    missing = str(tmp_path / "none.toml")
    assert refused("--config", missing) == f"--config {missing}: cannot read (No such file or directory)"
    bad = write(tmp_path, "bad.toml", "lr = [1\n")
    assert refused("--config", bad).startswith(f"--config {bad}: not valid TOML: ")
    one = write(tmp_path, "one.json", "{}")
    assert refused("--config", one, "--config", one).startswith("--config given 2 times")


def test_help_shows_config_and_block_size_among_the_common_flags():
    # N7: --block-size, which every GPT run sets, was not among --help's flags
    parser = cli.build_parser()
    short = next(a for a in parser._actions if a.option_strings == ["-h", "--help"]).text(parser)
    for flag in ("--config", "--block-size"):
        assert flag in cli.COMMON_FLAGS and f"\n  {flag} " in short


def test_the_shipped_example_parses_and_is_the_readme_recipe():
    example = os.path.join(REPO, "examples", "shakespeare_char.toml")
    args = cli.parse(["--config", example], quiet=True)
    assert (args.data, args.model, args.block_size, args.batch_size, args.steps) == \
        ("data/shakespeare-chars", "gpt:layers=4,heads=4,width=128", 64, 3, 2000)
    with open(os.path.join(REPO, "README.md")) as f:
        assert "--config examples/shakespeare_char.toml" in f.read()


def test_a_resumed_run_records_its_config_lists_its_own_optimizer_and_goes_on_with_its_clock(tmp_path, job):
    # N6: the merged flags in the final record and each checkpoint; N7: a
    # resume's elapsed and time_s went back to 0, its final record timed its
    # last run alone, and `hpctrain checkpoint` listed an Adam run's momentum.
    import h5py
    from hpctrain import checkpoint
    path = write(tmp_path, "run.toml", "hidden = [16]\nsteps = 4\nbatch-size = 8\nlog_every = 2\nlr = 1e-3\n")
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    flags = ["--config", path, "--lr", "2e-3", "--metrics", metrics, "--checkpoint-dir", ckpt, "--timeout", "60"]
    r = job(1, *flags)
    assert r.returncode == 0, r.stderr
    with h5py.File(checkpoint_file(checkpoint_path(ckpt, 4)), "r") as f:
        first = json.loads(f.attrs["config"])
        elapsed, segments = float(f.attrs["elapsed_s"]), int(f.attrs["segments"])
    assert (first["hidden"], first["steps"], first["batch_size"], first["lr"]) == ([16], 4, 8, 2e-3)
    assert elapsed > 0 and segments == 1
    r = job(1, *flags, "--steps", "6")
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps, final = [rec for rec in records if "event" not in rec], records[-1]
    assert [rec["step"] for rec in steps] == [2, 4, 6] and steps[2]["time_s"] > elapsed, records
    assert final["config"] == dict(first, steps=6)
    assert final["segments"] == 2 and final["total_wall_s"] > final["wall_s"] + elapsed * 0.99, final
    assert final["total_compute_s"] > final["compute_s"], final
    with h5py.File(checkpoint_file(checkpoint_path(ckpt, 6)), "r") as f:
        assert json.loads(f.attrs["config"]) == final["config"] and int(f.attrs["segments"]) == 2
    from io import StringIO
    from contextlib import redirect_stdout
    out = StringIO()
    with redirect_stdout(out):
        assert checkpoint.main([str(ckpt)]) == 0
    assert "optimizer adam" in out.getvalue() and "adam_betas 0.9,0.999" in out.getvalue()
    assert "momentum" not in out.getvalue(), out.getvalue()
