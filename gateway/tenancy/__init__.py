"""Who is calling and what they owe (torch-free): tenants and their keys (`tenants`, `accounts`,
`keys`), operator keys (`operators`), usage and the bill (`usage`, `usage_spool`), token quotas
(`quota`), rate limits (`ratelimit`), and the audit log (`audit`)."""
