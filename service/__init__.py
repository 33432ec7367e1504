"""maingrad.service: stores analyzer reports and runtime records and answers CI."""
