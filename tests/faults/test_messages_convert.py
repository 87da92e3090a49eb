"""mg-convert's messages: a missing config field is named with what to do, every hint
names a flag the subcommand has, Megatron's --ckpt-step (alias --iteration) picks the
iteration, and --overwrite replaces an earlier output only once the new one is complete."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from fault_helpers import exit_code, tree_digest

from mg.ckpt_convert.cli import build_parser, main

SUBCOMMANDS_WITH_STEP = ("export-hf", "inspect", "import-megatron", "export-megatron", "reshard")


def _flags_of(command: str) -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return {flag for action in sub._actions for flag in action.option_strings}


def _named_flags(message: str) -> set[str]:
    return set(re.findall(r"(--[a-z][a-z-]*[a-z])", message))


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    code = exit_code(lambda: main(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_config_missing_a_field_names_file_field_and_remedy(artifacts, tmp_path, capsys) -> None:
    source = tmp_path / "hf"
    shutil.copytree(artifacts / "hf", source)
    config = json.loads((source / "config.json").read_text())
    del config["n_layer"]
    (source / "config.json").write_text(json.dumps(config))

    code, _, err = _run(["import-hf", str(source), "--save", str(tmp_path / "ck")], capsys)

    assert code == 2, err
    assert "Traceback" not in err and "KeyError" not in err
    assert f"{source / 'config.json'}: no 'n_layer' field, which a gpt2 config needs" in err, err
    assert "Download config.json again" in err and "add the field" in err
    assert not (tmp_path / "ck").exists()


def test_import_hf_hints_name_only_its_own_flags(artifacts, tmp_path, capsys) -> None:
    source = tmp_path / "hf"
    shutil.copytree(artifacts / "hf", source)
    weights = source / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])

    code, _, err = _run(["import-hf", str(source), "--save", str(tmp_path / "ck")], capsys)

    assert code == 2, err
    assert "incomplete download?" in err
    assert "iteration" not in err, err  # a Hugging Face folder has no iterations to pick
    assert _named_flags(err) <= _flags_of("import-hf"), err


def test_export_hf_hint_names_ckpt_step(artifacts, tmp_path, capsys) -> None:
    load = tmp_path / "dist"
    shutil.copytree(artifacts / "dist", load)
    shard = load / "iter_0000002" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])

    code, _, err = _run(["export-hf", "--load", str(load), "--save", str(tmp_path / "hf")], capsys)

    assert code == 2, err
    assert "(--ckpt-step N)" in err, err
    assert _named_flags(err) <= _flags_of("export-hf"), err


def test_missing_iteration_names_ckpt_step(artifacts, tmp_path, capsys) -> None:
    code, _, err = _run(["inspect", str(artifacts / "torch"), "--ckpt-step", "7"], capsys)
    assert code == 2, err
    assert "iteration=N" not in err, err
    assert _named_flags(err) <= _flags_of("inspect"), err


@pytest.mark.parametrize("command", SUBCOMMANDS_WITH_STEP)
def test_ckpt_step_is_the_flag_and_iteration_its_alias(command: str) -> None:
    assert {"--ckpt-step", "--iteration"} <= _flags_of(command)


def test_help_says_iteration_is_an_alias(capsys) -> None:
    assert exit_code(lambda: main(["export-hf", "--help"])) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--ckpt-step N, --iteration N" in out
    assert "--iteration is an alias" in out


def test_ckpt_step_and_iteration_read_the_same_save(artifacts, capsys) -> None:
    outputs = []
    for flag in ("--ckpt-step", "--iteration"):
        code, out, err = _run(["inspect", str(artifacts / "torch"), flag, "2", "--json"], capsys)
        assert code == 0, err
        outputs.append(json.loads(out))
    assert outputs[0] == outputs[1]
    assert outputs[0]["iteration"] == 2


# --- --save and --overwrite --------------------------------------------------------------------

WRITERS = ("import-hf", "export-hf", "import-megatron", "export-megatron", "reshard", "format")


@pytest.mark.parametrize("command", WRITERS)
def test_every_writer_has_overwrite(command: str) -> None:
    assert "--overwrite" in _flags_of(command)


def test_existing_save_is_refused_and_kept(artifacts, tmp_path, capsys) -> None:
    save = tmp_path / "hf"
    shutil.copytree(artifacts / "hf", save)
    before = tree_digest(save)

    code, _, err = _run(
        ["export-hf", "--load", str(artifacts / "dist"), "--save", str(save)], capsys
    )

    assert code == 2, err
    assert f"--save {save} already exists" in err and "--overwrite" in err, err
    assert tree_digest(save) == before


def test_overwrite_replaces_an_earlier_export(artifacts, tmp_path, capsys) -> None:
    save = tmp_path / "hf"
    shutil.copytree(artifacts / "hf", save)
    (save / "stale.safetensors").write_bytes(b"from an earlier export")
    argv = ["export-hf", "--load", str(artifacts / "dist"), "--save", str(save), "--overwrite"]

    code, out, err = _run(argv, capsys)

    assert code == 0, err
    assert f"wrote {save}" in out
    assert not (save / "stale.safetensors").exists()
    assert tree_digest(save) == tree_digest(artifacts / "hf")
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no staging or old copy left


def test_failed_overwrite_keeps_the_earlier_output(artifacts, tmp_path, capsys) -> None:
    save = tmp_path / "hf"
    shutil.copytree(artifacts / "hf", save)
    before = tree_digest(save)
    load = tmp_path / "dist"
    shutil.copytree(artifacts / "dist", load)
    shard = load / "iter_0000002" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])

    argv = ["export-hf", "--load", str(load), "--save", str(save), "--overwrite"]
    code, _, err = _run(argv, capsys)

    assert code == 2, err
    assert tree_digest(save) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dist", "hf"]


def test_overwrite_never_deletes_the_input(artifacts, tmp_path, capsys) -> None:
    load = tmp_path / "dist"
    shutil.copytree(artifacts / "dist", load)
    before = tree_digest(load)
    for save in (load, tmp_path):
        argv = ["export-hf", "--load", str(load), "--save", str(save), "--overwrite"]
        code, _, err = _run(argv, capsys)
        assert code == 2, err
        assert "choose a --save outside --load" in err, err
    assert tree_digest(load) == before


def test_overwrite_refuses_a_folder_that_is_not_an_output(artifacts, tmp_path, capsys) -> None:
    save = tmp_path / "notes"
    save.mkdir()
    (save / "todo.txt").write_text("keep me")
    argv = ["import-hf", str(artifacts / "hf"), "--save", str(save), "--overwrite"]

    code, _, err = _run(argv, capsys)

    assert code == 2, err
    assert "todo.txt" in err and "not a checkpoint or Hugging Face model" in err, err
    assert (save / "todo.txt").read_text() == "keep me"


def test_import_hf_overwrite_replaces_an_earlier_import(artifacts, tmp_path, capsys) -> None:
    save = tmp_path / "ck"
    argv = ["import-hf", str(artifacts / "hf"), "--save", str(save)]
    assert _run(argv, capsys)[0] == 0
    first = tree_digest(save)
    (save / "iter_0000009").mkdir()  # something the new import does not write

    code, _, err = _run([*argv, "--overwrite"], capsys)

    assert code == 0, err
    assert tree_digest(save) == first
    assert not (save / "iter_0000009").exists()


@pytest.mark.parametrize("value", ["0", "-3", "abc"])
def test_bad_ckpt_step_is_one_line_naming_the_flag(artifacts, value: str, capsys) -> None:
    code, _, err = _run(["inspect", str(artifacts / "torch"), "--ckpt-step", value], capsys)
    assert code == 2, err
    assert "Traceback" not in err
    assert f"argument --ckpt-step/--iteration: {value!r} is not a saved iteration" in err, err


def test_damaged_tracker_names_ckpt_step(artifacts, tmp_path, capsys) -> None:
    load = tmp_path / "torch"
    shutil.copytree(artifacts / "torch", load)
    (load / "latest_checkpointed_iteration.txt").write_text("garbage\n")
    code, _, err = _run(["export-hf", "--load", str(load), "--save", str(tmp_path / "h")], capsys)
    assert code == 2, err
    assert "or pass --ckpt-step N." in err and "explicit iteration" not in err, err


def test_config_field_of_the_wrong_type_is_named(artifacts, tmp_path, capsys) -> None:
    source = tmp_path / "hf"
    shutil.copytree(artifacts / "hf", source)
    config = json.loads((source / "config.json").read_text())
    config["n_embd"] = None
    (source / "config.json").write_text(json.dumps(config))

    code, _, err = _run(["import-hf", str(source), "--save", str(tmp_path / "ck")], capsys)

    assert code == 2, err
    assert f"{source / 'config.json'}: a field holds a value of the wrong type" in err, err
    assert "null there: " in err and "n_embd" in err and "download config.json again" in err
