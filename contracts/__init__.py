"""maingrad.contracts: what the parts agree on, and the only thing they import from one another.

- `report`: the analyzer's report model (findings, fingerprints, severities), read by the service.
- `records`: the runtime record schema the hooks write and the service reads.
- `anomalies`: the anomaly codes a record can carry, their meaning and their fix.

Standard library only, so the hooks can import it without pulling in anything else.
"""
