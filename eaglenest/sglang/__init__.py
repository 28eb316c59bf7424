"""The SGLang backend: the extraction client, the server launcher and the in-server plugin."""
