"""Real models' routing recordings read into ids-only traces (`pyspice trace import`).

One module per recording format (csv_ids, vllm_jsonl), the checks they share
(recording), which files and formats an import reads (inputs), and the import
itself (run).
"""

from pyspice.formats.importers.inputs import FORMATS, detect_format, list_inputs
from pyspice.formats.importers.recording import RecordingError
from pyspice.formats.importers.run import ImportOptions, ImportSummary, ModelShape, import_recording

__all__ = [
    "FORMATS",
    "ImportOptions",
    "ImportSummary",
    "ModelShape",
    "RecordingError",
    "detect_format",
    "import_recording",
    "list_inputs",
]
