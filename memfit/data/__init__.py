"""Training data: files, record formats, chat templates, loss masks, packing, the batch order and the cache."""
