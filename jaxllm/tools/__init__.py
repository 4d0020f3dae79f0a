"""Tool calling: the formats models write calls in (`parsers`) and the constraints that force a call (`choice`)."""
