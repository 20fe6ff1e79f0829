"""`python -m train generate`: sample from a trained model with its chat template, so a user
can see what SFT did. One --prompt, or (--interactive / no --prompt) a chat on stdin: one line
per turn, an empty line or end of input stops.

The prompt is the tokenizer's chat template up to where the assistant's reply starts
(prompt_for_generation), and generation stops at the end-of-turn token, exactly as SFT framed
the training examples. A model without a chat template (a pretraining run's final/) has never
seen one, so its prompt is continued as plain text instead, and the user is told.

An encoder-decoder (T5, BART: AutoModelForSeq2SeqLM, chosen from the folder's config) reads the
prompt as its source and writes the reply as its target. A span-corruption pretraining run's
model fills the prompt's <extra_id_N> sentinels: its reply shows them, each before the text it
puts in that place.

Decoding: sampling (temperature 0.7, top_k 50) by default; --greedy, --num_beams (beam search),
--repetition_penalty and --no_repeat_ngram_size as transformers' generate() takes them. Where the
folder's generation_config.json holds decoding settings (a run's GENERATION_CONFIG), they are the
defaults instead, read as plain generate() reads them; a flag overrides each.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch

from train.config import knobs
from train.config.flags import ArgParser
from train.core.device import resolve_device
from train.core.errors import UsageError
from train.core.files import odd_kind, read_user_file
from train.core.generation import settings_problem, value_problem
from train.core.remote_code import refuse_custom_code
from train.data.chat.encode import TOOL_CALL_TOKEN, prompt_for_generation, stop_token_ids
from train.data.chat.render_bounds import RenderFailed
from train.data.chat.template_table import plain_prompt
from train.data.chat.turns import TOOLS_ROLE, BadRecord, parse_tools
from train.models.build import context_length
from train.models.family import CAUSAL, family_of
from train.models.load import load_folder

# The tool's decoding where neither a flag nor the model folder's generation_config.json says:
# sampling, as a chat demo wants variety (the kit's runs save no decoding settings of their own).
TOOL_DEFAULTS = {"max_new_tokens": 128, "do_sample": True, "temperature": 0.7, "top_k": 50, "num_beams": 1,
                 "repetition_penalty": 1.0, "no_repeat_ngram_size": 0}  # fmt: skip
# Settings that say how to decode: where the folder's generation_config.json names any, it decides
# sampling too, as plain generate() reads it (do_sample off unless it says on: ChatLM's beams).
DECODING = {
    "do_sample",
    "num_beams",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "no_repeat_ngram_size",
}
# ignored (and warned of) by greedy/beams
SAMPLING_ONLY = ("temperature", "top_k", "top_p", "min_p", "typical_p")
# What AutoTokenizer reads a tokenizer from; a folder with none of them has no tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "vocab.txt")
# The folder's JSON files that Python's json reads (tokenizer.json is read by the Rust tokenizer).
SETTINGS_FILES = ("config.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")
DEFAULT_MODEL = Path(knobs.default("output_dir")) / "latest" / "final"


def parser() -> ArgParser:
    p = ArgParser(
        prog="python -m train generate",
        description="Reply with a trained model and its chat template: sampling, greedy or beam search.",
        epilog="Decoding defaults: the model folder's generation_config.json where it sets them (a run's "
        "GENERATION_CONFIG), else the defaults shown; each flag overrides.",
    )
    p.add_argument(
        "--model", default=str(DEFAULT_MODEL), help="a run's final/ folder (default: runs/latest/final)"
    )
    p.add_argument("--prompt", help="one user message; without it, read one message per line from stdin")
    p.add_argument("--interactive", action="store_true", help="chat on stdin (the default without --prompt)")
    p.add_argument("--system", help="a system message put before the conversation")
    p.add_argument(
        "--tools", help="the tools the model may call: a JSON file or JSON text, a list of function schemas"
    )
    # Decoding: each flag's default is what the model folder's generation_config.json says (a
    # run's GENERATION_CONFIG), else the tool's own (TOOL_DEFAULTS).
    p.add_argument("--max_new_tokens", type=int, help="most tokens in one reply (default 128)")
    how = p.add_mutually_exclusive_group()
    how.add_argument(
        "--do_sample",
        dest="do_sample",
        action="store_const",
        const=True,
        help="sample the reply (the default, unless the folder's generation_config.json decides)",
    )
    how.add_argument("--greedy", dest="do_sample", action="store_const", const=False,
                     help="no sampling: the likeliest token each step (or the likeliest beam, with "
                          "--num_beams)")
    p.add_argument("--temperature", type=float, help="sampling temperature (default 0.7); 0: greedy")
    p.add_argument("--top_k", type=int, help="sample among the k likeliest tokens (default 50)")
    p.add_argument("--num_beams", type=int, help="beam search over this many beams (default 1: none)")
    p.add_argument("--repetition_penalty", type=float,
                   help="penalize tokens already in the text, > 1 (default 1.0: off; ChatLM 1.1)")
    p.add_argument("--no_repeat_ngram_size", type=int,
                   help="never repeat an n-gram of this many tokens (default 0: off; ChatLM 4)")
    p.add_argument("--seed", type=int, default=0, help="seeds the sampling")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N | mps")
    p.add_argument("--trust_remote_code", action="store_true", help="let the model folder run its own code")
    return p


def load(model_dir: str, device: str, trust_remote_code: bool):
    from transformers.utils import logging as hf_logging

    from train.core.device import resolve_device

    hf_logging.disable_progress_bar()  # a "Loading weights" bar before each reply is noise here

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise UsageError(
            f"--model {model_dir}: not a model folder (no config.json); give a run's final/ folder"
        )
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise UsageError(
            f"--model {model_dir}: no tokenizer files in the folder ({', '.join(TOKENIZER_FILES[:2])}); "
            "give a run's final/ folder, which holds its tokenizer"
        )
    refuse_custom_code(path, "--model", trust_remote_code, allow="--trust_remote_code lets it run")
    model, tok = load_folder(path, f"--model {model_dir}", trust_remote_code)
    # A run saved before the kit wrote use_cache into generation_config.json has the cache off,
    # which makes generate() many times slower; a forward pass per token needs no other setting.
    model.generation_config.use_cache = True
    dev, _ = resolve_device(device)
    return model.to(dev).eval(), tok, dev


class Chat:
    """The conversation so far and the reply to the next message."""

    def __init__(self, model, tok, device, args):
        self.model, self.tok, self.device, self.args = model, tok, device, args
        self.templated = tok.chat_template is not None
        self.layout = (family_of(model) or CAUSAL).layout
        self.context = context_length(model.config)
        self.turns: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
        if args.tools:
            if not self.templated:
                raise UsageError(f"--tools: {args.model} has no chat template to put tools in (a pretraining "
                                 f"or TEMPLATE=none run)")
            self.turns.insert(0, {"role": TOOLS_ROLE, "tools": read_tools(args.tools)})
        # Turns kept however long the chat grows: the tools list and the system message.
        self.fixed = len(self.turns)
        self.options = decoding(args, saved_decoding(model, args.model))
        self.max_new_tokens = self.options.pop("max_new_tokens")

    def _prompt_ids(self) -> list[int]:
        if self.templated:
            try:
                text = prompt_for_generation(self.tok, self.turns)
            except RenderFailed as err:  # a template that loops, recurses or grows past the bound
                raise UsageError(f"--model {self.args.model}: its chat template cannot render the chat: "
                                 f"{err.reason}") from None
        else:
            text = plain_prompt(self.turns)
        return self.layout.prompt_ids(self.tok, text, self.templated)

    def reply(self, message: str, keep: bool) -> str:
        self.turns.append({"role": "user", "content": message})
        ids = self._prompt_ids()
        # Oldest exchanges go first when the conversation outgrows the model's context.
        first = self.fixed
        while len(ids) + self.max_new_tokens > self.context and len(self.turns) > first + 1:
            del self.turns[first : first + 2]
            ids = self._prompt_ids()
        if not ids:  # an empty prompt, or a tokenizer without a vocabulary
            self.turns.pop()
            raise UsageError(f"--prompt: the tokenizer of {self.args.model} makes no tokens of it")
        if len(ids) >= self.context:
            self.turns.pop()
            raise UsageError(
                f"--prompt: {len(ids)} tokens with the template; the model's context is {self.context}"
            )
        new = self.layout.new_tokens(self.max_new_tokens, self.context, len(ids))
        input_ids = torch.tensor([ids], device=self.device)
        # The folder's own settings (top_p, length_penalty ...) with the resolved ones over them;
        # greedy and beam search drop the sampling-only ones transformers would warn about.
        config = copy.deepcopy(self.model.generation_config)
        sampling = self.options["do_sample"]
        if not sampling:
            for name in SAMPLING_ONLY:
                setattr(config, name, None)
        stops = stop_token_ids(self.tok) if self.templated else [self.tok.eos_token_id]
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else stops[0]
        config.update(
            **{k: v for k, v in self.options.items() if sampling or k not in SAMPLING_ONLY},
            max_new_tokens=new, eos_token_id=stops, pad_token_id=pad,
        )
        torch.manual_seed(self.args.seed)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids,
                generation_config=config,
                attention_mask=torch.ones_like(input_ids),
            )
        text = self._decode(out[0, self.layout.reply_start(len(ids)) :].tolist())
        if keep and self.templated:
            self.turns.append({"role": "assistant", "content": text})
        else:
            self.turns.pop()
        return text


    def _decode(self, ids: list[int]) -> str:
        if not self.templated and self.layout.encoder_decoder:  # span corruption: sentinels place each piece
            drop = {self.tok.pad_token_id, self.tok.eos_token_id, self.model.config.decoder_start_token_id}
            return self.tok.decode([i for i in ids if i not in drop]).strip()
        # Special tokens are markup, dropped; but a tool call's marker is what says the reply
        # is a call and not text, so it stays (and a kept turn renders back to the same ids).
        call_id = self.tok.convert_tokens_to_ids(TOOL_CALL_TOKEN) if self.templated else None
        if call_id == self.tok.unk_token_id:  # a template of its own, without the kit's markers
            call_id = None
        parts, piece = [], []
        for token in [*ids, None]:
            if token is None or token == call_id:
                parts.append(self.tok.decode(piece, skip_special_tokens=True))
                piece = []
            else:
                piece.append(token)
        return TOOL_CALL_TOKEN.join(parts).strip()


def read_tools(value: str) -> list[dict]:
    """--tools: a JSON file's path, or the JSON itself (what starts like JSON: a long JSON text is
    no file name)."""
    try:
        text = (
            value
            if value.lstrip().startswith(("[", "{"))
            else read_user_file(value, "--tools").decode("utf-8")
        )
        return parse_tools(text)
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"--tools: cannot read {value}: {err}") from None
    except BadRecord as err:
        raise UsageError(f"--tools: {err}") from None


def saved_decoding(model, folder: str) -> dict:
    """The decoding settings the model folder's generation_config.json holds (a run's
    GENERATION_CONFIG): those that differ from transformers' defaults, checked as the flags are."""
    saved = model.generation_config.to_diff_dict()
    # Every setting generate() would follow, not only the decoding ones: beams, ids, remote decodings.
    problem = settings_problem(
        {k: v for k, v in saved.items() if not k.startswith("_") and k != "temperature"},
        model.get_input_embeddings().num_embeddings,
    )
    if problem:
        raise UsageError(f"--model {folder}: generation_config.json's {problem[0]}: {problem[1]}")
    found = {k: saved[k] for k in DECODING | {"max_new_tokens"} if saved.get(k) is not None}
    for key, value in found.items():
        problem = None if key == "temperature" and value == 0 else value_problem(key, value)  # 0: greedy
        if problem:
            raise UsageError(f"--model {folder}: generation_config.json's {key}: {problem}")
    return found


def decoding(args, saved: dict) -> dict:
    """The reply's generate() settings: the tool's defaults < the folder's generation_config.json
    < the flags. Without --do_sample / --greedy, a --temperature above 0 or a --top_k asks for
    sampling, and else a --num_beams above 1 for beam search without it (transformers' meaning)."""
    options = dict(TOOL_DEFAULTS)
    if DECODING & saved.keys():
        options["do_sample"] = False
    options.update({k: saved[k] for k in options if k in saved})
    flags = {k: getattr(args, k) for k in options if getattr(args, k) is not None}
    if args.do_sample is None and (args.top_k is not None or (args.temperature or 0) > 0):
        flags["do_sample"] = True
    elif args.do_sample is None and (args.num_beams or 1) > 1:
        flags["do_sample"] = False
    options.update(flags)
    if options["temperature"] == 0:  # the tool's switch for greedy, before --greedy existed
        options["do_sample"] = False
    return options


def check_flags(args) -> None:
    """One line for a bad decoding flag, before the model is loaded."""
    for key in ("max_new_tokens", "num_beams", "repetition_penalty", "no_repeat_ngram_size", "top_k"):
        value = getattr(args, key)
        problem = None if value is None else value_problem(key, value)
        if problem:
            raise UsageError(f"--{key}: {problem}")
    if args.temperature is not None and not 0 <= args.temperature < float("inf"):  # nan fails both
        raise UsageError(f"--temperature: expected a number >= 0 (0: greedy), got {args.temperature}")
    if not -(2**63) <= args.seed < 2**64:  # torch.manual_seed's range
        raise UsageError(f"--seed: expected a whole number from -2**63 to 2**64 - 1, got {args.seed}")
    try:
        resolve_device(args.device)
    except RuntimeError:  # torch.device("bogus")
        raise UsageError(
            f"--device: expected auto | cpu | cuda | cuda:N | mps, got {args.device!r}"
        ) from None
    except UsageError as err:
        raise UsageError(str(err).replace(f"DEVICE={args.device}", f"--device {args.device}")) from None


def check_folder(folder: str) -> None:
    """One line for a FIFO, socket or device among the model folder's files, which transformers
    would open and wait on forever (or read without end: /dev/zero), and for a settings file
    nested deeper than Python's JSON reader goes (a RecursionError deep inside the load)."""
    path = Path(folder)
    for entry in sorted(path.iterdir()) if path.is_dir() else ():
        kind = odd_kind(entry)
        if kind:
            raise UsageError(f"--model {folder}: {entry.name} is {kind}, not a regular file")
    for name in SETTINGS_FILES:
        if (path / name).is_file():
            try:
                json.loads(read_user_file(path / name, f"--model {folder}"))
            except RecursionError:
                raise UsageError(f"--model {folder}: {name} is nested too deep to read") from None
            except (OSError, ValueError):
                pass  # the load names what is wrong with it


def generate_main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    check_flags(args)
    check_folder(args.model)
    model, tok, device = load(args.model, args.device, args.trust_remote_code)
    chat = Chat(model, tok, device, args)
    if not chat.templated:
        how = chat.layout.pick(
            "continuing the prompt as plain text",
            "the prompt + eos is the encoder's source (as TEMPLATE=none SFT trains it; for a span-corruption "
            "model write <extra_id_0> ... where it should fill in text)",
        )
        print(f"note: {args.model} has no chat template: {how}", file=sys.stderr)
    if args.prompt is not None and not args.interactive:
        print(chat.reply(args.prompt, keep=False))
        return 0
    if args.prompt is not None:
        print(chat.reply(args.prompt, keep=True), flush=True)
    tty = sys.stdin.isatty()
    if tty:
        print("chat with the model; an empty line ends", file=sys.stderr)
    while True:
        print("you> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line.strip():  # end of input or an empty line
            if not tty:
                print(file=sys.stderr)
            return 0
        if not tty:  # a terminal echoes what is typed; piped input is shown so the reply has its question
            print(line.strip(), file=sys.stderr)
        print("model> ", end="", file=sys.stderr, flush=True)  # stderr: stdout holds the replies alone
        print(chat.reply(line.strip(), keep=True), flush=True)
