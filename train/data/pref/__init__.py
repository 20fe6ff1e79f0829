"""Preference training's data (DPO and its kin): records in the formats users have read into pairs
(pref_formats), tokenized through SFT's templates and truncation (pref_encode) and cached
(pref_cache), batched as chosen rows then rejected rows, padded or packed (pref_batching);
preference is the front door that returns the train and validation data. Imports train/core and
train/data (SFT's readers, templates, cache machinery, samplers and packing), never the root
config.py or a model."""
