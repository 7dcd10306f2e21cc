"""The embedded cluster for a laptop (`qmq dev`) and the end-to-end demo on it (`qmq demo`)."""
