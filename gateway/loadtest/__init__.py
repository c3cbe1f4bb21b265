"""`loraplex loadtest`: skewed, shifting, multi-tenant traffic against our OpenAI API, and its report."""
