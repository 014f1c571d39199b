"""A run and the data it meets: whether a run's data folder still holds the data the run trained on (a folder
prepared again since holds other ids, perhaps of another tokenizer), and whether data was tokenized with the
tokenizer of the run `--init-from` starts from. Each says what is wrong in the user's own terms, before a later
check would find a symptom of it (a fingerprint, a vocabulary size) and name the wrong cause."""

from __future__ import annotations

from pathlib import Path

from gptlab import checkpoint as ck
from gptlab import rundir
from gptlab.errors import GptlabError


def as_typed(path: str | Path) -> str:
    """`path` as the user would type it: relative to the working folder when it lies inside it (a run records its
    data folder whole)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def recorded_fingerprint(run: str | Path) -> str | None:
    """The fingerprint (batches.Dataset.fingerprint) of the data `run` trained on, from its newest checkpoint whose
    state.json reads; None when none records one (no checkpoint yet, an import, a run from before fingerprints)."""
    for c in ck.list_checkpoints(Path(run), "step") + ck.list_checkpoints(Path(run), "best"):
        try:
            return ck.read_state(c).data_fingerprint
        except (GptlabError, OSError):
            continue
    return None


def check_data_unchanged(run: str | Path, data_dir: str | Path) -> None:
    """GptlabError when `data_dir` is the folder `run` trained on (its config.json's "data") and was prepared again
    since: its data is not the data the run's checkpoints recorded."""
    from gptlab.data.batches import load_dataset

    saved = rundir.read_run_config(run).get("data")
    if not isinstance(saved, str) or Path(saved).resolve() != Path(data_dir).resolve() or \
            not (Path(data_dir) / "meta.json").is_file():
        return
    recorded = recorded_fingerprint(run)
    if recorded is not None and recorded != load_dataset(data_dir).fingerprint():
        raise GptlabError(f"{as_typed(data_dir)} was prepared again after {as_typed(run)} trained on it, so it no "
                          f"longer holds the run's data; prepare that data there again, or train a new --run on "
                          f"this one")


def check_data_tokenizer(data_dir: str | Path, source: str | Path) -> None:
    """GptlabError when the prepared data in `data_dir` was tokenized with another tokenizer than the gptlab run
    `source`'s: neither its own nor its own with the chat markers added (fine-tuning on conversations adds those).
    Data not prepared yet, or a Hugging Face folder as `source`, is checked when training starts (hf.init_tensors)."""
    from gptlab.chat import rows_added
    from gptlab.tokenizer import ChatTokenizer, load as load_tokenizer

    file = Path(data_dir) / rundir.TOKENIZER
    if not rundir.is_run(source) or not file.is_file():
        return
    theirs, ours = load_tokenizer(Path(source) / rundir.TOKENIZER), load_tokenizer(file)
    try:
        fits = ours.to_dict() == theirs.to_dict() or rows_added(theirs, ours)
    except GptlabError:  # conversations prepared with another base tokenizer
        fits = False
    if not fits:
        chat = " with the chat markers" if isinstance(theirs, ChatTokenizer) else ""
        plain = " (or --tokenizer gpt2)" if theirs.kind == "gpt2" and not chat else ""
        raise GptlabError(f"{data_dir} was tokenized with another tokenizer than {source} (a {ours.kind} tokenizer of "
                          f"{ours.vocab_size:,} ids, not its {theirs.kind} tokenizer{chat} of "
                          f"{theirs.vocab_size:,}); prepare it with --tokenizer-from {source}{plain}")
