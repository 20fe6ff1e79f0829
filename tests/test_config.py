"""Config: precedence, validation naming the launcher variable, derived numbers, --help."""

import pytest

import config
from train.config.flags import field_docs, parse_training_args
from train.core.errors import UsageError


def test_precedence_default_preset_flag():
    cfg = parse_training_args("pretrain", ["--preset", "optimized", "--batch_size", "48"])
    assert cfg.optim.batch_size == 48  # flag beats preset
    assert cfg.optim.gradient_accumulation_steps == 4  # preset beats default
    assert cfg.data.num_workers == 4 and cfg.data.pin_memory and cfg.system.tf32
    assert cfg.optim.learning_rate == config.OptimConfig().learning_rate  # default stays


def test_guides_numbers_are_the_presets():
    base = config.resolve("baseline", {})
    opt = config.resolve("optimized", {})
    assert (base.optim.batch_size, base.optim.gradient_accumulation_steps) == (8, 1)
    assert (base.system.precision, base.data.num_workers) == ("fp32", 0)
    assert (opt.optim.batch_size, opt.optim.gradient_accumulation_steps, opt.data.num_workers) == (32, 4, 4)
    assert opt.data.prefetch_factor == 4 and opt.data.persistent_workers


def test_derived_numbers():
    cfg = config.resolve(None, {"batch_size": 16, "gradient_accumulation_steps": 2})
    assert cfg.effective_batch_size() == 32
    assert cfg.effective_batch_size(world_size=4) == 128
    assert cfg.tokens_per_step(1024) == 32 * 1024


@pytest.mark.parametrize(
    "argv, variable",
    [
        (["--batch_size", "abc"], "BATCH_SIZE"),
        (["--batch_size", "0"], "BATCH_SIZE"),
        (["--gradient_accumulation_steps", "-1"], "GRADIENT_ACCUM"),
        (["--max_length", "1"], "MAX_LENGTH"),
        (["--model_size", "huge"], "MODEL_SIZE"),
        (["--learning_rate", "nan"], "LEARNING_RATE"),
        (["--precision", "fp8"], "PRECISION"),
        (["--pin_memory", "maybe"], "PIN_MEMORY"),
        (["--run_name", "a b"], "RUN_NAME"),
        (["--run_name", "../escape"], "RUN_NAME"),
        (["--device", "tpu"], "DEVICE"),
        (["--epochs", "0"], "EPOCHS"),
        (["--data_path", "/no/such/file.txt"], "DATA_PATH"),
        (["--fp16", "--bf16"], "ENABLE_FP16"),
    ],
)
def test_bad_values_name_the_variable(argv, variable):
    with pytest.raises(UsageError) as err:
        parse_training_args("pretrain", argv)
    assert variable in str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_flag_is_one_line():
    with pytest.raises(UsageError, match="--bogus"):
        parse_training_args("pretrain", ["--bogus", "1"])


def test_switch_flags_and_bool_values():
    cfg = parse_training_args(
        "pretrain", ["--fp16", "--gradient_checkpointing", "--pin_memory", "0", "--tf32"]
    )
    assert cfg.system.precision == "fp16"
    assert cfg.model.gradient_checkpointing and not cfg.data.pin_memory and cfg.system.tf32


def test_every_field_has_a_docstring():
    docs = field_docs()
    missing = [name for name in config.FIELD_SECTION if not docs.get(name)]
    assert missing == []
