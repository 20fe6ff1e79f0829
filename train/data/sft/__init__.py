"""SFT's data: formats and turns read into one conversation shape (sft_formats, sft_turns),
tokenized with the loss mask (sft_data) and cached (sft_cache), packed (packing), batched
(sft_batching); fine_tuning is the front door that returns the train and validation data. May
import data/'s shared modules (records, json_lines, cache_files, holdout, loader, text); of this
folder, data/ imports only sft_batching (its samplers and the seq2seq collator serve pretraining
too)."""
