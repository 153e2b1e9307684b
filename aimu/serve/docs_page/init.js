"use strict";
// Starts Swagger UI on /docs. A file of this server, not an inline script: the page's
// Content-Security-Policy runs scripts from 'self' only. The page's own <script> tag
// says where the OpenAPI document is (data-openapi), so a root_path is honoured.
(() => {
  const { openapi } = document.currentScript.dataset;
  window.ui = SwaggerUIBundle({
    url: openapi,
    dom_id: "#swagger-ui",
    layout: "BaseLayout",
    deepLinking: true,
    showExtensions: true,
    showCommonExtensions: true,
    validatorUrl: null, // never send the document to validator.swagger.io
    presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset],
  });
})();
