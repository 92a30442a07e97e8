"""File formats: traces, sidecars, model headers, routers and cost profiles on disk.

Plain readers and writers (numpy, gguf): no native code, nothing that runs a model.
"""
