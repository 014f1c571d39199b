"""Planted bugs of chat (issue 27): the chat tokenizer's rendering and mask, prepare --chat, rows and lessons of
conversations, the vocabulary grown for the markers, the markers' rows under LoRA and in PEFT's files."""

from planted import Planted

TOK = "src/gptlab/tokenizer.py"
CONV = "src/gptlab/data/conversations.py"
CHAT = "src/gptlab/chat.py"
T = "tests/test_conversations.py"
L = "tests/test_lora_chat.py"

PLANTED = [
    Planted("chat: the system's tokens trained too", TOK, "ChatTokenizer.render",
            [('trained += [False] + [message["role"] == "assistant"] * len(content)',
              'trained += [False] + [message["role"] != "user"] * len(content)')], T),
    Planted("chat: a message rendered without its end marker", TOK, "ChatTokenizer.render",
            [('content = self.encode(message["content"]) + [self.end_id]',
              'content = self.encode(message["content"])')], T),
    Planted("chat: the markers decode to nothing", TOK, "ChatTokenizer.decode_bytes",
            [('                out += CHAT_TOKENS[i - first].encode() if i is not None else b""',
              '                out += b""')], T),
    Planted("chat: a long conversation split before every assistant turn", CONV, "pieces",
            [('if current and messages[i]["role"] != "assistant" and messages[i - 1]["role"] == "assistant":',
              'if current and messages[i]["role"] == "assistant":')], T),
    Planted("chat: the pieces of a split conversation lose its system message", CONV, "pieces",
            [("    head, out, body = rendered[:lead], [], []", "    head, out, body = [], [], []")], T),
    Planted("chat: the held-out count truncated instead of rounded", CONV, "held_out",
            [("    n = min(max(1, round(count * fraction)), count - 1)",
              "    n = min(max(1, int(count * fraction)), count - 1)")], T),
    Planted("chat: --chat-loss all leaves each piece's first id out", CONV, "write_chat",
            [("            trained[:] = 1", "            trained[1:] = 1")], T),
    Planted("chat: meta.json moved in first, so a failed move leaves a folder that looks prepared", CONV, "write_chat",
            [('key=lambda n: n == "meta.json"', 'key=lambda n: n != "meta.json"')], T),
    Planted("chat: an assistant turn of exactly the context refused", CONV, "pieces",
            [("and len(rendered[-1][0]) > context:", "and len(rendered[-1][0]) >= context:")], T),
    Planted("chat: rows train the first target past their last whole conversation", "src/gptlab/data/batches.py",
            "get_chat_batch",
            [("    whole = at < starts[last][:, None]", "    whole = at <= starts[last][:, None]")], T),
    Planted("chat: rows cut one token early", "src/gptlab/data/batches.py", "get_chat_batch",
            [('    last = np.searchsorted(starts, picked + block_size + 1, side="right") - 1',
              '    last = np.searchsorted(starts, picked + block_size, side="right") - 1')], T),
    Planted("chat: micro-batches weighted alike however many lessons they hold", "src/gptlab/training/step.py",
            "lesson_weights", [("    return [n * parallel.world_size / total for n in counts]",
              "    return [torch.tensor(1.0 / len(counts)) for n in counts]")], T),
    Planted("chat: each process averages over its own lessons only", "src/gptlab/training/step.py", "lesson_weights",
            [("    total = parallel.mean(torch.stack(counts).sum()) * parallel.world_size\n"
              "    return [n * parallel.world_size / total for n in counts]",
              "    total = torch.stack(counts).sum()\n    return [n / total for n in counts]")],
            "tests/test_distributed.py::test_conversations_train_in_two_processes_like_in_one"),
    Planted("chat: the markers' new rows start at the last row, not the mean", CHAT, "grow_vocab",
            [("            grown[keep:] = old[:keep].double().mean(0).to(old.dtype)",
              "            grown[keep:] = old[keep - 1]")], T),
    Planted("chat: the oldest single message dropped, not the oldest turn", CHAT, "fit_context",
            [("        kept = kept[:turns[0]] + kept[end:]", "        kept = kept[:turns[0]] + kept[turns[0] + 1:]")], T),
    Planted("chat: conversations one token longer than a row trained on", "src/gptlab/training/preflight.py",
            "check_data", [("        if longest > need:", "        if longest > need + 1:")], T),
    Planted("chat: the LM head ignores the markers' trained rows under LoRA", "src/gptlab/lora.py",
            "TrainableTokensHead.forward",
            [("        logits[..., tokens.token_ids] = F.linear(x, tokens.token_values)", "        pass")],
            L),
    Planted("chat: the markers' ids not saved with the adapters", "src/gptlab/lora.py", "is_adapter",
            [('name.endswith((".token_values", ".token_ids"))', 'name.endswith((".token_values",))')], L),
    Planted("chat: PEFT's trainable tokens exported off their values", "src/gptlab/hf/peft.py", "export_peft",
            [("        own[PEFT_TOKENS] = own.pop(TOKEN_VALUES)", "        own[PEFT_TOKENS] = own.pop(TOKEN_VALUES) * 1.01")],
            L),
]
