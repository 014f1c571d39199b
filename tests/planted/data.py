"""Planted bugs of the data pipeline: readers, token files and shards, prepare's staging and resume."""

from planted import Planted

SHARDS = "tests/test_shards.py"
CORPUS = "tests/test_corpus.py"

PLANTED = [
    Planted("data: a resumed token file is not cut back to its checkpoint", "src/gptlab/tokenfiles.py",
            [("        self.file.truncate(end)\n", "")],
            f"{SHARDS}::test_a_resumed_token_file_is_cut_back_to_its_checkpoint"),
    Planted("data: the open shard is fsynced without its buffer flushed", "src/gptlab/tokenfiles.py",
            [("    def sync(self) -> None:\n        self.file.flush()\n", "    def sync(self) -> None:\n")],
            f"{SHARDS}::test_every_checkpoint_follows_its_shards_on_disk"),
    Planted("data: the checkpoint does not sync the shards it names", "src/gptlab/staging.py",
            [("        for w in writers:\n            w.sync()\n", "        for w in writers:\n            w.completed = False\n")],
            f"{SHARDS}::test_every_checkpoint_follows_its_shards_on_disk"),
    Planted("data: the last JSON line is dropped when the file has no final newline", "src/gptlab/readers.py",
            [("    text = _record_text(source.name, number + 1, carry, text_field)\n    if text:\n        yield (text,)\n",
              "")],
            f"{CORPUS}::test_the_last_json_line_counts_without_a_final_newline"),
    Planted("data: no NUL-byte check (UTF-16 read as text)", "src/gptlab/corpus.py",
            [('            if "\\x00" in text:\n', '            if "\\x00" in text and False:\n')],
            f"{CORPUS}::test_a_utf16_file_is_binary_though_it_is_valid_utf8"),
    Planted("data: ShardedTokens[i] looks up each shard's first token in the shard before", "src/gptlab/tokenfiles.py",
            [('shard = int(np.searchsorted(self.offsets, index, "right")) - 1',
              'shard = int(np.searchsorted(self.offsets, index, "left")) - 1')],
            f"{SHARDS}::test_every_index_of_a_sharded_split_is_the_concatenation_of_its_files"),
    Planted("data: a shard whose count differs from the manifest is read", "src/gptlab/tokenfiles.py",
            [("        if len(array) != entry.get(\"tokens\"):\n", "        if False:\n")],
            f"{SHARDS}::test_a_shard_whose_count_differs_from_the_manifest_is_refused"),
    Planted("data: Ctrl-C inside the first checkpoint deletes the staging folder", "src/gptlab/staging.py",
            [("progress = None if self.committed else self._read_progress()",
              "progress = None if self.committed else self.progress")],
            f"{SHARDS}::test_ctrl_c_at_each_step_of_a_checkpoint_keeps_what_is_on_disk_and_resumes"),
    Planted("data: prepare leaves an inherited ignored SIGINT ignored", "src/gptlab/data.py",
            [("        signal.signal(signal.SIGINT, signal.default_int_handler)\n", "        pass\n")],
            f"{SHARDS}::test_sigint_to_a_real_prepare_keeps_its_checkpoint_and_the_rerun_finishes_it"),
]
