"""The chat library every mode after pretraining shares: records in the formats users have read into one
conversation shape (formats, turns) or into preference pairs (pair_formats), rendered and tokenized with
the loss mask (templates, template_table, chat_template, render_bounds, encode, pair_encode; a prompt
rendered for generation: encode.prompt_for_generation), tokenized once on one keyed, memmapped cache
engine (cache; the conversations' files: conversation_cache, the pairs': pair_cache), and batched
(batching: samplers and the padded collators; pair_batching; packing). A mode's thin door
(train/data/sft.py, train/data/preference.py) calls it; the model's layout (train/models Family.layout)
picks what differs for an encoder-decoder. May import data/'s shared modules (records, json_lines,
cache_files, holdout, loader, text, tokenize) and train/models' family; of this folder, data/ outside the
doors imports only batching (its samplers and the seq2seq collator serve pretraining too)."""
