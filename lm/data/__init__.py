"""Data: corpora, the tokenizer recipe, the on-disk token cache, token windows and the data modules,
and the synthetic recall task (MQAR). Nothing here imports the model.

Import the module you need (lm.data.corpora, lm.data.modules, ...): the package itself loads
nothing, so reading a tokenizer never imports Lightning."""
