import pytest

from gptlab.config import (PRESETS, ModelConfig, PrepareConfig, SampleConfig, TrainConfig, build, field_help,
                           get_preset, parse_value)
from gptlab.configfile import read_config_file
from gptlab.errors import GptlabError


def test_every_preset_builds_valid_settings():
    for name, preset in PRESETS.items():
        model = build(ModelConfig, preset.model, {})
        train = build(TrainConfig, preset.train, {})
        assert model.n_embd % model.n_head == 0, name
        assert train.max_steps > 0


def test_char_small_and_gpt2_presets_have_the_documented_shapes():
    small = build(ModelConfig, get_preset("char-small").model, {})
    assert (small.n_layer, small.n_head, small.n_embd, small.block_size, small.dropout) == (6, 6, 384, 256, 0.2)
    gpt2 = build(ModelConfig, get_preset("gpt2").model, {})
    assert (gpt2.n_layer, gpt2.n_head, gpt2.n_embd, gpt2.block_size, gpt2.vocab_size) == (12, 12, 768, 1024, 50257)


def test_overrides_are_parsed_to_the_field_type():
    assert parse_value(ModelConfig, "n_layer", "6") == 6
    assert parse_value(TrainConfig, "lr", "3e-4") == 3e-4
    assert parse_value(ModelConfig, "bias", "false") is False
    cfg = build(ModelConfig, get_preset("char-quick").model, {"n_layer": 2})
    assert cfg.n_layer == 2


@pytest.mark.parametrize("cls, field, text, words", [
    (ModelConfig, "n_layer", "two", "integer"),
    (TrainConfig, "lr", "fast", "number"),
    (ModelConfig, "bias", "maybe", "true or false"),
])
def test_unparseable_values_are_clear_errors(cls, field, text, words):
    with pytest.raises(GptlabError, match=words):
        parse_value(cls, field, text)


@pytest.mark.parametrize("cls, bad, words", [
    (TrainConfig, {"batch_size": 0}, "batch_size must be a positive"),
    (TrainConfig, {"lr": -1.0}, "learning rate"),
    (TrainConfig, {"max_steps": -5}, "max_steps must be a positive"),
    (ModelConfig, {"n_embd": 100, "n_head": 3}, "divisible"),
    (ModelConfig, {"attention": "flash9"}, "attention must be one of"),
    (SampleConfig, {"temperature": -0.1}, "temperature"),
    (SampleConfig, {"top_p": 1.5}, "top_p"),
    (PrepareConfig, {"tokenizer": "word"}, "tokenizer must be one of char, bpe, gpt2, not 'word'"),
    (PrepareConfig, {"workers": 0}, "--workers must be at least 1, not 0"),
    (PrepareConfig, {"shard_tokens": 0}, "--shard-tokens must be at least 1, not 0"),
    (PrepareConfig, {"val_fraction": 1.0}, r"val_fraction must be in \(0, 1\): training needs a validation split"),
    (PrepareConfig, {"val_fraction": float("nan")}, "val_fraction must be a finite number"),
    (PrepareConfig, {"vocab_size": "1024"}, "vocab_size must be an integer, not '1024'"),
])
def test_invalid_settings_are_refused(cls, bad, words):
    with pytest.raises(GptlabError, match=words):
        cls(**bad)


def test_unknown_preset_and_setting_name_the_choices():
    with pytest.raises(GptlabError, match="unknown preset 'gpt5'.*char-small"):
        get_preset("gpt5")
    with pytest.raises(GptlabError, match="unknown setting 'n_layers'"):
        build(ModelConfig, {}, {"n_layers": 3})


def test_a_config_file_reads_its_paths_relative_to_its_own_folder(tmp_path):
    folder = tmp_path / "expé 1"
    folder.mkdir()
    (folder / "c.toml").write_text('preset = "char-small"\ndata = "../corpus/data"\nrun = "runs/x"\nlr = 0.002\n'
                                   '[model]\nn_layer = 2\n[train]\nmax_steps = 7\n', encoding="utf-8")
    model, train, rest = read_config_file(folder / "c.toml")
    assert model == {"n_layer": 2} and train == {"lr": 0.002, "max_steps": 7}
    assert rest == {"preset": "char-small", "data": str(folder / ".." / "corpus" / "data"),
                    "run": str(folder / "runs" / "x")}
    (folder / "abs.json").write_text(f'{{"data": "{tmp_path / "d"}", "model": {{"n_head": 2}}}}')
    assert read_config_file(folder / "abs.json") == ({"n_head": 2}, {}, {"data": str(tmp_path / "d")})


def test_prepare_settings_default_as_prepare_always_did_and_a_validation_corpus_needs_no_fraction():
    assert vars(PrepareConfig()) == {
        "tokenizer": "char", "tokenizer_from": "", "allow_special": False, "vocab_size": 1024, "val_fraction": 0.1,
        "seed": 0, "val": [], "encoding": "utf-8", "text_field": "text", "include": [], "exclude": [], "strict": False,
        "workers": None, "shard_tokens": 100_000_000,
        "chat": False, "context": 1024, "chat_loss": "assistant"}
    assert PrepareConfig(val=["held-out/"], val_fraction=0.0).val == ["held-out/"]  # the fraction is not used then


def test_every_setting_says_what_it_does():
    for cls in (ModelConfig, TrainConfig, SampleConfig, PrepareConfig):
        assert all(text for text, _, _ in field_help(cls).values()), cls.__name__


def test_chat_settings_are_checked_once():
    assert PrepareConfig(chat=True, context=8, chat_loss="all").context == 8  # the smallest context taken
    with pytest.raises(GptlabError, match="--context must be at least 8 tokens, not 7"):
        PrepareConfig(chat=True, context=7)
    with pytest.raises(GptlabError, match="chat_loss"):
        PrepareConfig(chat=True, chat_loss="user")
