"""Config precedence: defaults < recipe < config file < explicit flags; damaged config files and impossible
numbers are one clear error each."""

import argparse
import json

import pytest

from unimae.cli import build_parser, main
from unimae.training.config import TrainConfig, resolve_config


def _parse(argv):
    return build_parser().parse_args(["train", *argv])


def test_defaults_are_the_cpu_recipe_with_paper_method_numbers():
    config = resolve_config(_parse([]))
    assert (config.lora_r, config.lora_alpha, config.lr, config.options.alpha, config.options.p_mar, config.steps) == (
        16,
        32,
        1e-4,
        0.1,
        0.0,  # the CPU recipe's measured choice; the paper's 0.5 is in --recipe paper
        100,
    )
    assert (config.batch_size, config.max_length) == (16, 128)
    paper = resolve_config(_parse(["--recipe", "paper"]))
    assert (paper.batch_size, paper.max_length, paper.options.p_mar) == (32, 512, 0.5)
    gem, gem_paper = (resolve_config(_parse([*recipe, "--method", "gem"])) for recipe in ([], ["--recipe", "paper"]))
    assert (gem.options.gem_contrastive_lr_scale, gem_paper.options.gem_contrastive_lr_scale) == (1.0, 0.1)  # LoRA


def test_paper_recipe_then_file_then_flags(tmp_path):
    assert (resolve_config(_parse(["--recipe", "paper"])).batch_size, 32)[0] == 32
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"recipe": "paper", "max_length": 256, "p_mar": 0.3}))
    config = resolve_config(_parse(["--config", str(path), "--p-mar", "0.4"]))
    assert (config.batch_size, config.max_length, config.options.p_mar) == (32, 256, 0.4)


def test_paper_recipe_gives_in_batch_methods_the_whole_batch_as_negatives(caplog):
    """GEM and SimCSE contrast within a micro-batch: the paper's 31 negatives need one micro-batch of 32."""
    gem = resolve_config(_parse(["--recipe", "paper", "--method", "gem"]))
    assert (gem.batch_size, gem.micro_batch_size) == (32, 32)
    assert resolve_config(_parse(["--recipe", "paper"])).micro_batch_size == 8  # UniMAE: per-example losses
    chosen = resolve_config(_parse(["--recipe", "paper", "--method", "gem", "--micro-batch-size", "16"]))
    assert chosen.micro_batch_size == 16  # an explicit flag still wins
    with caplog.at_level("WARNING", logger="unimae.training.methods.options"):
        chosen.validate()
    assert "15 negatives per text, not the 31 of the whole batch" in caplog.text


def test_yaml_config_and_bool_flags(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("steps: 7\nmerge: true\n")
    config = resolve_config(_parse(["--config", str(path), "--no-merge"]))
    assert config.steps == 7 and config.merge is False


def test_config_file_values_take_their_field_types(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lr: 1e-4\np_mar: 5e-1\nsteps: 20.0\n")  # YAML 1.1 reads 1e-4 as a string
    config = resolve_config(_parse(["--config", str(path)]))
    assert (config.lr, config.options.p_mar, config.steps) == (1e-4, 0.5, 20) and isinstance(config.steps, int)
    for bad, key in (("lr: fast\n", "lr"), ("steps: 2.5\n", "steps"), ("merge: 1\n", "merge"), ("- 1\n", "mapping")):
        path.write_text(bad)
        with pytest.raises(ValueError, match=key):
            resolve_config(_parse(["--config", str(path)]))


def test_unknown_key_and_bad_values_are_clear_errors(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"batchsize": 3}))
    with pytest.raises(ValueError, match="unknown keys"):
        resolve_config(_parse(["--config", str(path)]))
    with pytest.raises(ValueError, match="unknown recipe"):
        resolve_config(argparse.Namespace(recipe="gpu"))
    with pytest.raises(ValueError, match="p_mar"):
        TrainConfig.from_dict({"p_mar": 1.5}).validate()
    with pytest.raises(ValueError, match="p_mar_sampling must be one of"):  # choices hold outside argparse too
        TrainConfig(options={"p_mar_sampling": "Uniform"}).validate()
    with pytest.raises(ValueError, match="multiple of micro_batch_size"):
        TrainConfig(batch_size=16, micro_batch_size=8).validate(world_size=3)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):  # 0 % 8 == 0: would train nothing
        TrainConfig(batch_size=0).validate()
    with pytest.raises(ValueError, match="micro_batch_size must be >= 1"):
        TrainConfig(micro_batch_size=0).validate()
    with pytest.raises(ValueError, match="inside --output-dir"):  # the run would overwrite its own start
        TrainConfig(output_dir=str(tmp_path / "run"), init_adapter=str(tmp_path / "run" / "adapter")).validate()
    for flag in ("init_lora", "continue_adapter"):  # deeper too: an adapter's own init_adapter inside the run
        with pytest.raises(ValueError, match="inside --output-dir"):
            TrainConfig(output_dir=str(tmp_path / "run"), **{flag: str(tmp_path / "run" / "a" / "b")}).validate()
    TrainConfig(output_dir=str(tmp_path / "run2"), init_lora=str(tmp_path / "run" / "adapter")).validate()
    for flag in ("init_lora", "continue_adapter"):  # before: a raw AttributeError once the model had loaded
        with pytest.raises(ValueError, match="--full-params trains no LoRA"):
            TrainConfig(output_dir=str(tmp_path / "r"), full_params=True, **{flag: str(tmp_path / "a")}).validate()
    with pytest.raises(ValueError, match="names no module"):
        TrainConfig(lora_target_modules=" , ").validate()


def test_lora_target_modules_are_all_linear_or_a_list_of_names():
    """Before: 'q_proj,v_proj' went to peft as one string, a regex that matches no module path."""
    from unimae.training.config import lora_targets

    assert lora_targets("all-linear") == "all-linear"
    assert lora_targets("q_proj, v_proj") == ["q_proj", "v_proj"] and lora_targets("q_proj") == ["q_proj"]


@pytest.mark.parametrize(
    ("name", "content"),
    [("c.json", b'{"steps": 3,'), ("c.yaml", b"steps: [3\n"), ("c.json", b"\xff\xfe{}"), ("c.yaml", b"\xff: 1\n")],
)
def test_damaged_config_file_names_the_file(tmp_path, capsys, name, content):
    """Before: a malformed YAML file was a traceback, a malformed JSON one a message without the file name."""
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ValueError, match=f"config file {path}"):
        resolve_config({"config": str(path)})
    assert main(["train", "--config", str(path), "--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "Traceback" not in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("field", "value"), [("threads", -2), ("save_every", -1), ("ce_chunk_size", 0), ("alpha", -0.1)]
)
def test_impossible_numbers_are_named(field, value):
    """Before: --threads -2 was a RuntimeError traceback after loading the model, --ce-chunk-size 0 a
    'range() arg 3 must not be zero' in the first step, and negative --save-every / --alpha were accepted."""
    with pytest.raises(ValueError, match=f"{field} must be >= "):
        TrainConfig.from_dict({field: value}).validate()


def test_every_field_has_help_text():
    from dataclasses import fields

    assert all(f.metadata.get("help") for f in fields(TrainConfig))


def test_every_field_is_a_flag_with_method_options_grouped_last():
    from dataclasses import fields

    from unimae.training.config import METHOD_OPTIONS, add_config_arguments, option_fields

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    dests = [a.dest for a in parser._actions]
    shared = [f.name for f in fields(TrainConfig) if f.name != "options"]
    assert set(shared) | set(option_fields()) <= set(dests) and "options" not in dests
    assert max(dests.index(name) for name in shared) < min(dests.index(name) for name in option_fields())
    for options in METHOD_OPTIONS.values():  # an option several methods share is one flag: one default for all
        assert all(f.default == option_fields()[f.name].default for f in fields(options))
        assert all(f.metadata.get("help") for f in fields(options))


# config.json as the version before method options were nested wrote it: every method's options beside the rest
FLAT_CONFIG = {
    "num_summary_tokens": 1, "gem_plain_share": 0.8, "gem_switch_step": 100, "gem_summary_tokens": "new",
    "gem_summary_init": "mean", "gem_train_summary_rows": True, "gem_block_position": "uniform",
    "gem_positives": "prefix", "gem_prefix_dropout": 0.5, "gem_learn_logit_scale": True, "gem_max_logit_scale": 100.0,
    "gem_contrastive_lr_scale": 1.0, "gem_lr_schedule": "cosine", "temperature": 0.1, "dropout": 0.1,
    "dropout_on": "attention", "pooling": "auto", "data_weights": "", "symmetric_loss": True,
    "mask_false_negatives": True, "lm_weight": 0.5, "lm_texts": 0, "query_prompt": "q:", "document_prompt": "",
    "symmetric_sources": "", "matryoshka_dims": "8,16", "grad_cache_chunk": 0, "mntp_p_mask": 0.2,
    "model": "tiny-llama", "data": "pairs.jsonl", "output_dir": "runs/old", "recipe": "cpu", "method": "contrastive",
    "init_adapter": "", "continue_adapter": "", "steps": 3, "batch_size": 4, "micro_batch_size": 4, "max_length": 24,
    "lr": 0.005, "weight_decay": 0.0, "max_grad_norm": 1.0, "alpha": 0.1, "p_mar": 0.0, "p_mar_sampling": "fixed",
    "p_mrc": 0.5, "train_mask_token": False, "mask_token": "auto", "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
    "lora_target_modules": "all-linear", "full_params": False, "mrc_heads": 0, "mrc_intermediate_size": 0,
    "mrc_input": "corrupted", "mrc_positions": "scaled", "precision": "fp32", "ce_chunk_size": 1024,
    "gradient_checkpointing": False, "threads": 0, "seed": 0, "save_every": 0, "merge": False,
}  # fmt: skip


def test_an_old_flat_config_json_loads_and_resumes_as_the_nested_one(tmp_path):
    """Resume reads the run's config.json: one written flat by an earlier version gives the same config (the
    other methods' options dropped) as the nested one written now, and compares equal to it key by key."""
    from unimae.training.config import flat_values
    from unimae.training.methods import ContrastiveOptions

    old = TrainConfig.from_dict(FLAT_CONFIG)
    assert isinstance(old.options, ContrastiveOptions) and old.options.matryoshka_dims == "8,16"
    assert (old.options.temperature, old.options.lm_weight, old.lr) == (0.1, 0.5, 0.005)
    assert TrainConfig.from_dict(old.to_dict()) == old and old.to_dict()["options"]["query_prompt"] == "q:"
    (tmp_path / "config.json").write_text(json.dumps(FLAT_CONFIG))
    assert resolve_config(_parse(["--config", str(tmp_path / "config.json")])) == old
    old.save(tmp_path / "nested.json")
    assert resolve_config(_parse(["--config", str(tmp_path / "nested.json"), "--steps", "5"])).steps == 5
    flat, ours = flat_values(FLAT_CONFIG), old.flat()
    # fields added since: resume counts them at their defaults for the old run (trainer._changed_settings)
    added = {"init_lora", "device", "query_prompt_dropout", "lr_schedule", "lr_decay_from"}
    added |= {"distill_teacher", "distill_weight", "distill_temperature", "distill_loss", "lm_data"}
    assert set(ours) - set(flat) == added
    assert all(flat[k] == v for k, v in ours.items() if k in flat), "what resume compares: the same values"


def test_options_belong_to_their_method():
    config = resolve_config(_parse(["--method", "gem", "--num-summary-tokens", "3", "--temperature", "0.1"]))
    assert (config.options.num_summary_tokens, config.options.temperature) == (3, 0.1)
    with pytest.raises(ValueError, match=r"--method mntp has no options \['p_mar'\]"):
        TrainConfig(method="mntp", options={"p_mar": 0.5})
    with pytest.raises(ValueError, match="takes MNTPOptions"):
        TrainConfig(method="mntp", options=TrainConfig().options)
    with pytest.raises(ValueError, match="unknown config keys"):
        TrainConfig.from_dict({"batchsize": 3})


def test_a_flag_of_another_method_is_ignored_with_a_warning(caplog):
    with caplog.at_level("WARNING", logger="unimae.training.config"):
        config = resolve_config(_parse(["--method", "mntp", "--temperature", "0.3", "--mntp-p-mask", "0.3"]))
    assert config.options.mntp_p_mask == 0.3 and "temperature" not in config.flat()
    assert "--temperature: not options of --method mntp, ignored" in caplog.text
