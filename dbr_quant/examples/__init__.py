"""Built-in example data: the real pretrained all-MiniLM-L6-v2 and sentences to run it on."""
