"""The chat library every mode after pretraining shares: records in the formats users have read into one
conversation shape (formats, turns) or into preference pairs (pair_formats), rendered and tokenized with
the loss mask (templates, template_table, chat_template, render_bounds, encode, pair_encode), tokenized
once into a keyed, memmapped cache (cache: the engine and the conversations' files; pair_cache: the
pairs'), and batched (batching: samplers and the padded collators; pair_batching; packing). The modes'
thin doors (train/data/sft.py, train/data/preference.py) call it. May import data/'s shared modules
(records, json_lines, cache_files, holdout, loader, text, tokenize); of this folder, data/ outside the
doors imports only batching (its samplers and the seq2seq collator serve pretraining too)."""
