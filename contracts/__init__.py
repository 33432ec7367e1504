"""maingrad.contracts: what the parts agree on, and the only thing they import from one another.

- `report`: the analyzer's report model (findings, fingerprints, severities, the default failing severity),
  read by the service.
- `sarif`: maingrad's SARIF: the fingerprint key, severity -> level, finding -> result (analyzer and service).
- `records`: the runtime record's field table, `new_record`, `validate` and `json_schema`: what the hooks
  write and the service reads.
- `anomalies`: the anomaly codes a record can carry, their meaning and their fix.
- `extras`: which optional extra installs which module (for one-line "pip install" hints).

Standard library only, so the hooks can import it without pulling in anything else.
"""
